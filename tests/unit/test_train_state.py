"""Which checkpoint a run resumes from, when a save was cut short."""

import pytest

from megatron_grpo.train.state import latest_checkpoint


def make(root, name, complete=True):
    path = root / "checkpoints" / name
    path.mkdir(parents=True)
    if complete:
        (path / "metadata.json").write_text("{}")
    return path


def test_a_crash_mid_save_leaves_the_previous_checkpoint_in_use(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    good = make(tmp_path, "step_00000002")
    make(tmp_path, "step_00000004.partial", complete=False)  # the save that crashed
    (tmp_path / "checkpoints" / "latest").write_text("step_00000002")
    assert latest_checkpoint(tmp_path) == good


def test_a_pointer_to_an_incomplete_checkpoint_is_named(tmp_path):
    make(tmp_path, "step_00000003", complete=False)
    (tmp_path / "checkpoints" / "latest").write_text("step_00000003")
    with pytest.raises(FileNotFoundError, match="names step_00000003, which is not a complete"):
        latest_checkpoint(tmp_path)


def test_saves_cut_short_are_removed_and_complete_ones_kept(tmp_path):
    from megatron_grpo.train.state import checkpoints_dir, remove_partial_saves

    root, hf = checkpoints_dir(tmp_path), tmp_path / "hf"  # checkpoints and save_hf's models
    for name in ("step_00000001", "step_00000002.partial"):
        for folder in (root, hf):
            (folder / name).mkdir(parents=True)
            (folder / name / "shard").write_text("x")
    removed = [p.relative_to(tmp_path).as_posix() for p in remove_partial_saves(tmp_path)]
    assert removed == ["checkpoints/step_00000002.partial", "hf/step_00000002.partial"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]
    assert sorted(p.name for p in hf.iterdir()) == ["step_00000001"]

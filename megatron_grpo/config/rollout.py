"""The rollout side's sections: engines and sampling, prompt data, rewards, advantages."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

DATA_SUFFIXES = (".jsonl", ".parquet", ".arrow")
"""Data files by suffix; a path without a suffix (or an existing directory) is a saved
Hugging Face dataset folder."""


@dataclass(kw_only=True)
class ToolsConfig:
    """The built-in multi-turn tool loop (``rollout.hook: tools``, rollout/tools/loop.py).

    The model calls a tool by writing ``call_start <body> call_end``; generation stops at
    ``call_end`` (one token of the tokenizer), the tool runs, and its result, rendered by
    ``result_template`` and tokenized alone, is appended with loss mask 0 before the model
    goes on. ``rollout.max_new_tokens`` is the budget of everything after the prompt (the
    model's turns and the tool results together)."""

    names: list[str] = field(default_factory=lambda: ["calculator"])
    """Tools the model may call: the built-ins ``calculator`` (arithmetic) and ``python`` (a
    sandboxed Python process), or ``package.module:function`` (called by the function's
    name; sync or ``async def``; returns the result as text, raises on an error)."""
    max_turns: int = 4
    """Most model turns per episode; a tool call in the last one ends the episode as cut
    (finish type ``length``)."""
    call_start: str = "<tool_call>"
    """Text that opens a tool call."""
    call_end: str = "</tool_call>"
    """Text that closes a tool call: must be a single token (generation stops on it)."""
    call_format: Literal["json", "text"] = "json"
    """The call's body: ``json``, ``{"name": ..., "arguments": {...}}`` (Hermes, Qwen), the
    arguments passed by keyword; ``text``, ``name argument`` (the rest of the body is the
    tool's one argument)."""
    result_template: str = "<tool_response>{result}</tool_response>"
    """How a result goes back to the model: ``{result}`` is filled (a chat template's user
    or tool turn may be spelt out around it)."""
    max_result_chars: int = 1000
    """A longer result is cut to this many characters."""
    python_timeout_s: float = 5.0
    """The ``python`` tool's limit, wall clock and CPU time, per call."""
    python_memory_mb: int = 512
    """The ``python`` tool's address-space limit."""
    python_isolation: Literal["bwrap", "none"] = "bwrap"
    """How the ``python`` tool isolates model-written code. ``bwrap``: a bubblewrap box
    (namespaces, an unprivileged user, no network, no files but its own ``/tmp``); a
    machine that cannot make one refuses the run at start, naming what is missing.
    ``none``: limits only, the code runs as the trainer's user (unsafe; for trusted code)."""

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("rollout.tools.names is empty: name at least one tool")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"rollout.tools.names has duplicates: {self.names}")
        if self.max_turns < 1 or self.max_result_chars < 1 or self.python_memory_mb < 16:
            raise ValueError(
                "rollout.tools.max_turns and max_result_chars must be >= 1 and "
                f"python_memory_mb >= 16, got {self.max_turns}, {self.max_result_chars}, "
                f"{self.python_memory_mb}"
            )
        if self.python_timeout_s <= 0:
            raise ValueError(
                f"rollout.tools.python_timeout_s must be > 0, got {self.python_timeout_s}"
            )
        if not self.call_start or not self.call_end:
            raise ValueError("rollout.tools.call_start and call_end must not be empty")
        if "{result}" not in self.result_template:
            raise ValueError(
                f"rollout.tools.result_template must hold {{result}}, got {self.result_template!r}"
            )


@dataclass(kw_only=True)
class RolloutConfig:
    """Where generations come from and how they are sampled."""

    engine: Literal["embedded", "sglang"] = "embedded"
    """The embedded CPU server, or SGLang servers (started or at ``urls``)."""
    embedded_server: Literal["auto", "thread", "process"] = "auto"
    """engine=embedded: serve from a thread of the main rank, or from ``num_servers``
    processes of their own (``python -m megatron_grpo.rollout.embedded``, started and
    watched like launched SGLang servers), so that generation runs beside training; auto is
    process when max_staleness >= 1, else thread."""
    urls: list[str] = field(default_factory=list)
    """SGLang servers (or one sglang-router) to attach to when engine=sglang."""
    launch_command: str | None = None
    """Start the SGLang servers from this command template instead of attaching to ``urls``,
    e.g. ``python -m sglang.launch_server --model-path /ckpt --host {host} --port {port}``;
    ``{port}`` is filled per server (also ``{host}``, ``{index}``, ``{model}``: train.init
    when it is a HF directory, else the tokenizer's). Whatever the servers load, the trainer
    sends them the policy's weights before the first rollout."""
    num_servers: int = 1
    """How many servers ``launch_command`` starts, each on a free port."""
    server_host: str = "127.0.0.1"
    """Address the launched servers listen on (``{host}``)."""
    server_startup_timeout_s: float = 600.0
    """Limit for the launched servers to generate (``/health_generate``) and join the router."""
    server_log_dir: str | None = None
    """Where each launched server's log goes; None makes a temporary directory."""
    router_url: str | None = None
    """sglang-router to register the servers with and to generate through; weight
    updates still go to each server."""
    api_key_env: str | None = None
    """Name of an environment variable holding the servers' API key (SGLang's
    ``--api-key``), e.g. ``MGRPO_ROLLOUT_API_KEY``; None: no key. Every request to an
    engine then carries ``Authorization: Bearer <key>``; the embedded server processes are
    started with ``--api-key-env`` of this name, and servers started from
    ``launch_command`` get ``--api-key <key>`` appended. Only the name is in the config (and
    the run's saved config.yaml), never the key. Needed when embedded server processes
    listen beyond loopback (``server_host``)."""
    prompts_per_step: int = 8
    """Prompt groups per RL step."""
    samples_per_prompt: int = 4
    """Completions per prompt (the GRPO group size)."""
    max_new_tokens: int = 64
    """Generation budget per completion (also Dr. GRPO's default L)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra stop tokens besides the tokenizer's end of sequence."""
    mask_truncated: bool = False
    """Give completions cut by max_new_tokens no loss tokens (overlong filtering)."""
    max_concurrency: int = 64
    request_timeout_s: float = 600.0
    """Limit for one generation; one that runs longer is aborted on its server."""
    connect_timeout_s: float = 10.0
    """Limit for opening a connection to a server (retried like a refusal)."""
    control_timeout_s: float = 60.0
    """Limit for health, pause, abort and info calls."""
    weight_update_timeout_s: float = 600.0
    """Limit for one weight-update call."""
    sync_method: Literal["tensor", "disk", "distributed"] = "tensor"
    """How weights reach the servers after each step, from every pipeline stage's sender:
    ``tensor`` (an SGLang server: shared memory, so senders on its machine) and ``disk``
    (``sync_disk_dir`` visible to senders and servers) or ``distributed`` (a gloo/nccl
    broadcast group per stage), which needs neither."""
    sync_master_address: str = "127.0.0.1"
    """The main rank's host as the servers reach it (sync_method=distributed); senders on
    other hosts use their host's address."""
    sync_bucket_mb: int = 512
    """Largest bucket a stage sends at once (a request, a file or a broadcast)."""
    sync_disk_dir: str | None = None
    """sync_method=disk: where each push's directory is made (default: the system's
    temporary directory); each push's directory is removed once the engines loaded it."""
    check_weight_sync: bool = False
    """After each push, read the first rows of every weight back from every engine
    (``/get_weights_by_name``) and stop, naming them, if any differs from the learner's."""
    max_staleness: int = 0
    """0: each step generates its rollout, then trains on it (synchronous). k >= 1: the
    rollouts of the next steps are generated while the learner trains (asynchronous), each
    by a policy at most k weight versions older than the one it trains; samples a weight
    update interrupts go on under the new weights (partial rollouts)."""
    producer_cpus: list[int] = field(default_factory=list)
    """max_staleness >= 1: the CPU cores the rollout producer's process runs on (its HTTP
    client, decoding, rewards, advantages), e.g. the rollout side's rather than the
    learner's; empty: the trainer's."""
    dump_dir: str | None = None
    """Write each step's training samples here (jsonl)."""
    replay_dir: str | None = None
    """Train from samples dumped earlier instead of generating (no server)."""
    hook: str | None = None
    """Generate each sample with a rollout hook instead of one completion:
    ``package.module:function``, an ``async def`` taking (EpisodeInput, EngineSession) and
    returning an Episode (rollout/hook.py), or ``tools``, the built-in multi-turn tool loop
    (``rollout.tools``). None: one completion per sample."""
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    """The built-in tool loop's settings (read with ``hook: tools`` only)."""

    @property
    def embedded_process(self) -> bool:
        """The embedded engine serves from processes of its own."""
        if self.engine != "embedded":
            return False
        if self.embedded_server == "auto":
            return self.max_staleness > 0
        return self.embedded_server == "process"

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness must be >= 0, got {self.max_staleness}")
        if self.num_servers < 1:
            raise ValueError(f"rollout.num_servers must be >= 1, got {self.num_servers}")
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"rollout.top_k must be -1 (off) or >= 1, got {self.top_k}")
        timeouts = (
            "request_timeout_s",
            "connect_timeout_s",
            "control_timeout_s",
            "weight_update_timeout_s",
            "server_startup_timeout_s",
        )
        for name in timeouts:
            if getattr(self, name) <= 0:
                raise ValueError(f"rollout.{name} must be > 0, got {getattr(self, name)}")
        if self.hook is not None and self.max_staleness:
            raise ValueError(
                "rollout.hook with rollout.max_staleness >= 1 is not supported: a hook's "
                "episodes do not record the weight versions of their turns"
            )
        if self.producer_cpus and not self.max_staleness:
            raise ValueError(
                "rollout.producer_cpus places the rollout producer's process, which runs "
                "with rollout.max_staleness >= 1 only"
            )
        if any(c < 0 for c in self.producer_cpus):
            raise ValueError(
                f"rollout.producer_cpus must be CPU numbers >= 0, got {self.producer_cpus}"
            )
        if self.embedded_server != "auto" and self.engine != "embedded":
            raise ValueError("rollout.embedded_server is for rollout.engine=embedded")
        if self.api_key_env is not None and not self.api_key_env.isidentifier():
            raise ValueError(
                "rollout.api_key_env must name an environment variable (the key itself goes "
                f"in that variable, not in the config), got {self.api_key_env!r}"
            )
        if self.embedded_process and self.api_key_env is None and not is_loopback(self.server_host):
            raise ValueError(
                f"rollout.server_host={self.server_host!r} is beyond loopback: the embedded "
                "servers there need an API key (their --api-key); set rollout.api_key_env to "
                "the name of an environment variable holding it"
            )
        if self.hook is not None and self.hook != "tools":
            module, sep, name = self.hook.partition(":")
            if not (module and sep and name):
                raise ValueError(
                    f"rollout.hook must be 'tools' or 'package.module:function', got {self.hook!r}"
                )
        if self.engine == "sglang" and self.replay_dir is None:
            if not self.urls and not self.launch_command:
                raise ValueError("rollout.engine=sglang needs rollout.urls or launch_command")
            if self.urls and self.launch_command:
                raise ValueError("set rollout.urls (attach) or rollout.launch_command, not both")


def is_loopback(host: str) -> bool:
    """Whether a server listening on ``host`` is reachable from its own machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "" (every address), or a name that may resolve anywhere
        return False


@dataclass(kw_only=True)
class DataConfig:
    """Where the prompts come from and how they become token ids."""

    path: str | list[str] = field(default_factory=list)
    """A .jsonl, .parquet or .arrow file or a folder written by Hugging Face datasets'
    ``save_to_disk``, or a list of them (read in order)."""
    split: str = "train"
    """The split to read from a folder that holds a ``DatasetDict``."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string, or a list of {role, content} messages."""
    label_key: str = "label"
    """Column holding the reference answer handed to the reward function."""
    require_label: bool = True
    """Skip (and report) rows without a label; False gives such rows label None."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (a string becomes one user message)."""
    system_prompt: str | None = None
    """System message put before string prompts and message lists that have none."""
    max_prompt_length: int | None = None
    """Longest prompt, in tokens after templating. None (the default): the room a context
    leaves for a prompt, ``min(model.max_position_embeddings - max(rollout.max_new_tokens,
    eval.max_new_tokens), train.max_tokens_per_micro_batch - rollout.max_new_tokens)``, set
    when the config is built (the resolved config shows it)."""
    overlong_prompts: Literal["filter", "error"] = "filter"
    """What a prompt longer than ``max_prompt_length`` does. ``filter`` (the default): it is
    not in the dataset, on every process alike, and loading says how many were dropped in one
    line. ``error``: the run is refused before any worker starts, naming the first such
    prompt (the check reads and tokenizes every prompt first)."""
    shuffle: bool = True
    """Shuffle each epoch (the order depends only on seed and epoch)."""
    seed: int = 1234
    """Seed of the per-epoch shuffle."""

    def __post_init__(self) -> None:
        for p in self.paths:
            if Path(p).suffix and not p.endswith(DATA_SUFFIXES) and not Path(p).is_dir():
                raise ValueError(
                    f"data.path {p!r} must end in .jsonl, .parquet or .arrow, or be a saved "
                    "dataset folder"
                )
        if not self.prompt_key:
            raise ValueError("data.prompt_key must not be empty")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length must be >= 1, got {self.max_prompt_length}")
        if self.seed < 0:
            raise ValueError(f"data.seed must be >= 0, got {self.seed}")
        if self.system_prompt is not None and not self.apply_chat_template:
            # Without a template there is nowhere to put a system message.
            raise ValueError("data.system_prompt needs data.apply_chat_template=true")

    @property
    def paths(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path)


RewardType = Literal["math", "exact_match", "format", "remote", "custom"]


@dataclass(kw_only=True)
class RewardConfig:
    """The reward of a response: one main function, plus an optional weighted format term."""

    type: RewardType = "math"
    """Main reward function (each reads only its own parameters below)."""
    case_sensitive: bool = True
    """exact_match: compare case-sensitively."""
    format_pattern: str | None = None
    """Regex for the format reward (type=format, or format_weight != 0); compiled with DOTALL."""
    format_mode: Literal["fullmatch", "search"] = "fullmatch"
    """The whole response must match the pattern, or only some part of it."""
    format_match_score: float = 1.0
    """Format reward of a response that matches."""
    format_miss_score: float = 0.0
    """Format reward of a response that does not match."""
    format_weight: float = 0.0
    """Add format_weight * format reward to the main reward; 0 disables the term."""
    remote_url: str | None = None
    """remote: http(s) URL that is POSTed {"response", "label", "metadata"}."""
    remote_field: str = "reward"
    """remote: key of the reward (a number) in the JSON answer."""
    remote_timeout: float = 30.0
    """remote: seconds to wait for one answer."""
    remote_retries: int = 2
    """remote: extra attempts after a connection error, timeout or 5xx answer."""
    remote_retry_backoff: float = 0.5
    """remote: seconds before the first retry, doubled for each later one."""
    remote_batch_size: int | None = None
    """remote: POST {"batch": [...]} with up to this many samples and read a list of
    rewards from remote_field; None sends one request per sample."""
    custom_function: str | None = None
    """custom: ``package.module:function``, called as custom_style says; an ``async def``
    one is awaited for many samples (or batches) at once (max_concurrency)."""
    custom_pickle: str | None = None
    """custom: instead of custom_function, a file holding the function pickled; what
    ``megatron_grpo.train(reward_fn=...)`` writes (``<output_dir>/reward_fn.pkl``) for a
    function object that other processes cannot import by name. Unpickling runs code: give
    only a file you trust."""
    custom_style: Literal["auto", "native", "trl", "verl"] = "auto"
    """custom: how the function is called. native: ``fn(response, label, metadata) ->
    float`` per sample; trl: TRL's ``fn(prompts, completions, **kwargs) -> list[float]``
    once per batch, the item's columns as keyword arguments; verl: verl's
    ``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float |
    dict`` per sample. auto: by the names of its parameters (native when it has none of
    TRL's or verl's). docs/python_api.md has the arguments of each."""
    label_name: str | None = None
    """custom_style=trl: the keyword argument that carries the item's label; None: the
    label's column, data.label_key."""
    on_error: Literal["fail", "zero"] = "fail"
    """When a reward function raises, runs past timeout_s or returns a non-finite value:
    stop the run, or score 0."""
    math_timeout_s: int = 5
    """math: math-verify's own limit, in whole seconds, on parsing an answer and on each
    comparison; an answer past it counts as wrong (not as an error)."""
    num_workers: int = 0
    """Score with a synchronous reward function (math, exact_match, format, custom) in this
    many worker processes instead of one sample after another in the trainer; a worker
    still busy after timeout_s is killed. The function must be importable by its worker."""
    timeout_s: float = 60.0
    """Limit for one sample's reward in a worker process (num_workers > 0) or of an async
    custom function; past it the sample is a reward error (see on_error)."""
    max_concurrency: int = 64
    """An async custom function (``async def``) is awaited for up to this many samples at
    once; so is the remote reward when it sends one request per sample."""
    cache_size: int = 65536
    """A deterministic reward (math, exact_match, format, or a custom function with the
    attribute ``deterministic = True``) is called once per distinct (response, label,
    metadata); its values are kept for this many distinct ones, across batches (the
    least recently used go first). 0: call it for every sample."""

    def __post_init__(self) -> None:
        if self.type == "format" or self.format_weight != 0:
            if not self.format_pattern:
                raise ValueError("reward.format_pattern is needed by the format reward")
        if self.format_pattern is not None:
            try:
                re.compile(self.format_pattern)
            except re.error as e:
                raise ValueError(f"reward.format_pattern is not a valid regex: {e}") from None
        if self.type == "format" and self.format_weight != 0:
            raise ValueError("reward.format_weight adds a format term to another reward type")
        if self.type == "remote":
            if not self.remote_url or not self.remote_url.startswith(("http://", "https://")):
                raise ValueError(
                    "reward.type=remote needs an http(s) reward.remote_url, "
                    f"got {self.remote_url!r}"
                )
            if not self.remote_field:
                raise ValueError("reward.remote_field must not be empty")
        if self.remote_timeout <= 0:
            raise ValueError(f"reward.remote_timeout must be > 0, got {self.remote_timeout}")
        if self.remote_retries < 0 or self.remote_retry_backoff < 0:
            raise ValueError(
                "reward.remote_retries and reward.remote_retry_backoff must be >= 0, "
                f"got {self.remote_retries}, {self.remote_retry_backoff}"
            )
        if self.remote_batch_size is not None and self.remote_batch_size < 1:
            raise ValueError(f"reward.remote_batch_size must be >= 1, got {self.remote_batch_size}")
        if self.math_timeout_s < 1:
            raise ValueError(f"reward.math_timeout_s must be >= 1, got {self.math_timeout_s}")
        if self.num_workers < 0:
            raise ValueError(f"reward.num_workers must be >= 0, got {self.num_workers}")
        if self.cache_size < 0:
            raise ValueError(f"reward.cache_size must be >= 0, got {self.cache_size}")
        if self.timeout_s <= 0 or self.max_concurrency < 1:
            raise ValueError(
                "reward.timeout_s must be > 0 and reward.max_concurrency >= 1, "
                f"got {self.timeout_s}, {self.max_concurrency}"
            )
        if self.label_name == "":
            raise ValueError("reward.label_name must not be empty")
        if self.type == "custom" and self.custom_pickle is not None:
            if self.custom_function is not None:
                raise ValueError("give reward.custom_function or reward.custom_pickle, not both")
        elif self.type == "custom":
            module, sep, name = (self.custom_function or "").partition(":")
            if not (module and sep and name):
                raise ValueError(
                    "reward.type=custom needs reward.custom_function='package.module:function' "
                    f"(or reward.custom_pickle), got {self.custom_function!r}"
                )


@dataclass(kw_only=True)
class AdvantageConfig:
    """How rewards become advantages, and which groups are kept."""

    baseline: Literal["mean", "leave_one_out"] = "mean"
    """Group mean, or the mean of the other samples of the group (RLOO)."""
    scale_by_std: bool = True
    """Divide by the group's reward std (GRPO); False for Dr. GRPO."""
    std_eps: float = 1e-6
    """Added to the std before dividing."""
    dynamic_sampling: bool = False
    """Drop groups with zero reward spread and sample more prompts to fill the batch."""
    max_sampling_rounds: int = 4
    """Cap on generation rounds per step when dynamic sampling keeps too few groups."""

    def __post_init__(self) -> None:
        if self.std_eps < 0:
            raise ValueError(f"advantages.std_eps must be >= 0, got {self.std_eps}")
        if self.max_sampling_rounds < 1:
            raise ValueError(
                f"advantages.max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}"
            )

"""Reward functions and the scorer: hand-made answers, a local HTTP reward server, errors."""

import asyncio
import datetime
import json
import logging
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp
import pytest

from megatron_grpo.config import FormatRewardConfig, RemoteRewardConfig
from megatron_grpo.rewards import (
    FormatReward,
    MathReward,
    RemoteReward,
    RemoteRewardError,
    RewardConfig,
    RewardError,
    RewardScorer,
    exact_match,
    extract_boxed,
    load_function,
    math_reward,
)

# --------------------------------------------------------------------------- math


def test_extract_boxed_nested_and_last():
    assert extract_boxed(r"so \boxed{\frac{\sqrt{3}}{2}} done") == r"\frac{\sqrt{3}}{2}"
    assert extract_boxed(r"\boxed{1} then \boxed{ {2} }") == " {2} "
    assert extract_boxed(r"\boxed{3} and a truncated \boxed{4") == "3"
    assert extract_boxed("no box here") is None


# (response, label, reward now, reward of the hand-written comparison before math-verify)
MATH_TABLE = [
    # what the old comparison got wrong
    (r"\boxed{\frac12}", "1/2", 1.0, 0.0),  # LaTeX shorthand
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1.0, 0.0),
    (r"So it is $\frac{1}{2}$", "0.5", 1.0, 0.0),  # unboxed LaTeX
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0, 0.0),  # equal as expressions
    (r"\boxed{\pi/2}", r"\frac{\pi}{2}", 1.0, 0.0),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0, 0.0),
    (r"\boxed{[0, \infty)}", r"x \ge 0", 1.0, 0.0),  # an interval against an inequality
    (r"\boxed{\{1, 2, 3\}}", r"\{3, 2, 1\}", 1.0, 0.0),  # sets, in any order
    (r"\boxed{1, 2, 3}", "3, 2, 1", 1.0, 0.0),
    (r"\boxed{1,000,000}", "10^6", 1.0, 0.0),
    # what it got right, and still does
    (r"The answer is \boxed{\frac{1}{2}}.", "0.5", 1.0, 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0, 1.0),
    (r"\boxed{-\frac{3}{4}}", "-0.75", 1.0, 1.0),
    ("so it is 3/4", "0.75", 1.0, 1.0),
    ("First 3 then 4, so the answer is 17.", "17", 1.0, 1.0),
    (r"\boxed{1000}", "1,000", 1.0, 1.0),  # thousands separators
    ("It costs $1,000.", "1000", 1.0, 1.0),
    (r"\boxed{1{,}000}", "1000", 1.0, 1.0),
    (r"\boxed{\$1,000}", "1000", 1.0, 1.0),
    (r"\boxed{(1, 3]}", "(1,3]", 1.0, 1.0),  # intervals
    (r"\boxed{(1, 3]}", "(1,3)", 0.0, 0.0),
    (r"\boxed{(-\infty, 2) \cup (3, \infty)}", r"(-\infty,2)\cup(3,\infty)", 1.0, 1.0),
    (r"\boxed{12\text{ cm}}", "12", 1.0, 1.0),  # units
    (r"\boxed{5\,\text{m}}", "5", 1.0, 1.0),
    (r"\boxed{1,000\text{ m}}", "1000", 1.0, 1.0),
    (r"\boxed{90^\circ}", "90", 1.0, 1.0),
    (r"\boxed{50\%}", "50", 1.0, 1.0),
    (r"\boxed{x = -5}", "-5", 1.0, 1.0),
    (r"\boxed{0.3333333}", "1/3", 1.0, 1.0),  # rounded to 6 decimals
    (r"\boxed{0.33}", "1/3", 0.0, 0.0),
    (r"\boxed{7} was wrong, \boxed{8}", "8", 1.0, 1.0),  # the last box only
    (r"\boxed{5}", r"\boxed{5}", 1.0, 1.0),  # a boxed label is unboxed too
    (r"\boxed{\text{(B)}}", "(B)", 1.0, 1.0),
    (r"\boxed{ yes. }", "yes", 1.0, 1.0),  # not maths: compared as text
    (r"\boxed{B}", "A", 0.0, 0.0),
    (r"\boxed{10^{400}}", "10^{400}", 1.0, 1.0),
    (r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", 1.0, 1.0),
    (r"\boxed{\frac{1}{2}}", "2", 0.0, 0.0),
    (r"\boxed{4}", "5", 0.0, 0.0),
    ("I give up", "5", 0.0, 0.0),
]


@pytest.mark.parametrize("response, label, reward, old_reward", MATH_TABLE)
def test_math_reward(response, label, reward, old_reward):
    assert math_reward(response, label, {}) == reward


def test_math_table_has_what_the_old_comparison_got_wrong():
    fixed = [row for row in MATH_TABLE if row[2] != row[3]]
    assert len(MATH_TABLE) >= 20 and len(fixed) >= 10


def test_math_reward_needs_a_label():
    with pytest.raises(ValueError, match="needs a label"):
        math_reward(r"\boxed{1}", None, {})


def test_math_reward_gives_up_on_a_pathological_answer():
    start = time.monotonic()
    assert MathReward(timeout_s=1)(r"\boxed{(10^{100})!}", "5") == 0.0
    assert time.monotonic() - start < 10


def test_math_reward_refuses_a_thread():
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_raised(math_reward, "1", "1")))
    thread.start()
    thread.join()
    assert "must run in a main thread" in str(errors[0])


def _raised(fn, *args):
    try:
        fn(*args, {})
    except Exception as e:
        return e
    return None


# --------------------------------------------------------------------------- text


def test_exact_match():
    assert exact_match("  Paris \n", "Paris") == 1.0
    assert exact_match("New   York", "New York") == 1.0
    assert exact_match("paris", "Paris") == 0.0
    assert exact_match("paris", "Paris", case_sensitive=False) == 1.0
    assert exact_match("Paris!", "Paris") == 0.0


def test_format_reward():
    pattern = r"<think>.*</think>\s*<answer>.*</answer>"
    full = FormatReward(pattern)
    assert full("<think>a\nb</think>\n<answer>1</answer>") == 1.0  # DOTALL: spans lines
    assert full("preamble <think>a</think><answer>1</answer>") == 0.0
    search = FormatReward(pattern, mode="search", match_score=0.5, miss_score=-1.0)
    assert search("preamble <think>a</think><answer>1</answer>") == 0.5
    assert search("<answer>1</answer>") == -1.0


def test_scorer_math_plus_format():
    fmt = FormatRewardConfig(pattern=r".*\\boxed\{.*\}.*", weight=0.5)
    config = RewardConfig(type="math", format=fmt)
    scorer = RewardScorer(config)
    result = scorer.score([r"\boxed{2}", r"\boxed{3}", "2", "nothing"], ["2"] * 4, [{}] * 4)
    assert result.rewards == [1.5, 0.5, 1.0, 0.0]
    assert (result.num_errors, result.errors) == (0, [])


def test_scorer_exact_match_and_format_types():
    scorer = RewardScorer(RewardConfig(type="exact_match", case_sensitive=False))
    assert scorer.score(["YES", "no"], ["yes", "yes"], [{}, {}]).rewards == [1.0, 0.0]
    scorer = RewardScorer(RewardConfig(type="format", format=FormatRewardConfig(pattern="[0-9]+")))
    assert scorer.score(["12", "12a"], [None, None], [{}, {}]).rewards == [1.0, 0.0]


def test_config_errors():
    with pytest.raises(ValueError, match=r"reward\.format\.pattern is needed"):
        RewardConfig(type="format")
    with pytest.raises(ValueError, match=r"reward\.format\.pattern is needed"):
        RewardConfig(type="math", format=FormatRewardConfig(weight=0.1))
    with pytest.raises(ValueError, match=r"reward\.format\.pattern is not a valid regex"):
        FormatRewardConfig(pattern="(")
    with pytest.raises(ValueError, match=r"reward\.remote\.url"):
        RewardConfig(type="remote")
    with pytest.raises(ValueError, match="custom_function"):
        RewardConfig(type="custom", custom_function="no_colon")
    with pytest.raises(ValueError, match=r"reward\.remote\.timeout_s must be > 0"):
        RemoteRewardConfig(timeout_s=0)
    with pytest.raises(ValueError, match="lengths|one label"):
        RewardScorer(RewardConfig()).score(["a"], [], [])


# --------------------------------------------------------------------------- custom

CUSTOM_MODULE = """
import math

def by_metadata(response, label, metadata):
    return len(response) * metadata["scale"]

def flaky(response, label, metadata):
    if response == "boom":
        raise ZeroDivisionError("boom!")
    if response == "nan":
        return math.nan
    if response == "text":
        return "1.0"
    return 1.0

not_callable = 3
"""


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    name = "grpo_test_custom_rewards"
    (tmp_path / f"{name}.py").write_text(CUSTOM_MODULE)
    (tmp_path / "grpo_test_broken_rewards.py").write_text("raise RuntimeError('import-time bug')")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for module in (name, "grpo_test_broken_rewards"):
        sys.modules.pop(module, None)


def test_custom_function(custom_module):
    config = RewardConfig(type="custom", custom_function=f"{custom_module}:by_metadata")
    result = RewardScorer(config).score(["ab", "abc"], [None, None], [{"scale": 2}, {"scale": 1}])
    assert result.rewards == [4.0, 3.0]


def test_custom_function_errors_name_the_spec(custom_module):
    with pytest.raises(ValueError, match="'no_such_module_xyz:f': cannot import"):
        load_function("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="import-time bug"):
        load_function("grpo_test_broken_rewards:f")
    with pytest.raises(ValueError, match=f"'{custom_module}:missing'.* no attribute"):
        load_function(f"{custom_module}:missing")
    with pytest.raises(ValueError, match="is a int, not a callable"):
        RewardScorer(RewardConfig(type="custom", custom_function=f"{custom_module}:not_callable"))


def test_errors_score_zero_and_are_reported(custom_module, caplog):
    config = RewardConfig(type="custom", custom_function=f"{custom_module}:flaky", on_error="zero")
    responses = ["fine", "boom", "nan", "text", "fine"]
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.rewards"):
        result = RewardScorer(config).score(responses, [None] * 5, [{}] * 5)
    assert result.rewards == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert result.num_errors == 3
    assert result.errors[0] == "sample 1: ZeroDivisionError: boom!"
    assert result.errors[1].startswith("sample 2: ValueError: reward function returned non-finite")
    assert result.errors[2].startswith("sample 3: TypeError: reward function returned str")
    # One line for the batch, not one per sample.
    assert [r.getMessage() for r in caplog.records] == [
        f"reward custom {custom_module}:flaky: 3 of 5 samples failed (1 ZeroDivisionError, "
        "1 ValueError, 1 TypeError), scored 0; first: sample 1 (response 'boom'): "
        "ZeroDivisionError: boom!"
    ]


def test_error_fails_the_run(custom_module, caplog):
    config = RewardConfig(type="custom", custom_function=f"{custom_module}:flaky")
    with pytest.raises(RewardError) as info:
        RewardScorer(config).score(["fine", "boom", "nan"], [None] * 3, [{}] * 3)
    assert str(info.value) == (
        f"reward custom {custom_module}:flaky failed on sample 1 (response 'boom'): "
        "ZeroDivisionError: boom!"
    )
    assert info.value.index == 1 and isinstance(info.value.cause, ZeroDivisionError)


def test_warning_and_error_show_only_the_start_of_a_long_response(caplog):
    response = "x" * 1000
    scorer = RewardScorer(RewardConfig(type="math", on_error="zero"))
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.rewards"):
        result = scorer.score([response], [None], [{}])
    assert result.num_errors == 1
    assert "x" * 100 in caplog.text and "x" * 101 not in caplog.text
    with pytest.raises(RewardError, match="reward math failed on sample 0") as info:
        RewardScorer(RewardConfig(type="math")).score([response], [None], [{}])
    assert "x" * 100 in str(info.value) and "x" * 101 not in str(info.value)


# --------------------------------------------------------------------------- remote


class RewardServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, *, fail_first=0, status=500, delay=0.0):
        super().__init__(("127.0.0.1", 0), RewardHandler)
        self.fail_first = fail_first
        self.status = status
        self.delay = delay
        self.requests: list[dict] = []

    def handle_error(self, request, client_address):
        pass  # the timeout test hangs up before the answer: a broken pipe is expected

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}/score"


class RewardHandler(BaseHTTPRequestHandler):
    """Scores len(response) + 100 * (response == label), or fails on request."""

    server: RewardServer

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        time.sleep(self.server.delay)
        if len(self.server.requests) <= self.server.fail_first:
            return self._reply(self.server.status, {"error": "not now"})
        samples = body["batch"] if "batch" in body else [body]
        scores = [len(s["response"]) + 100.0 * (s["response"] == s["label"]) for s in samples]
        self._reply(200, {"score": scores if "batch" in body else scores[0], "extra": "x"})

    def _reply(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # keep the test output quiet
        pass


@pytest.fixture
def serve():
    servers = []

    def start(**kwargs):
        server = RewardServer(**kwargs)
        threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def remote_config(url, on_error="fail", **kwargs):
    defaults = dict(field="score", timeout_s=5.0, retry_backoff_s=0.01)
    remote = RemoteRewardConfig(url=url, **{**defaults, **kwargs})
    return RewardConfig(type="remote", remote=remote, on_error=on_error)


def test_remote_reward(serve):
    server = serve()
    scorer = RewardScorer(remote_config(server.url))
    result = scorer.score(["abc", "hi"], ["abc", "no"], [{"id": 1}, {"id": 2}])
    assert result.rewards == [103.0, 2.0]
    # The two requests run concurrently, so they may arrive in either order.
    assert {"response": "abc", "label": "abc", "metadata": {"id": 1}} in server.requests


def test_remote_reward_batches(serve):
    server = serve()
    scorer = RewardScorer(remote_config(server.url, batch_size=2))
    result = scorer.score(["a", "bb", "ccc"], ["a", "x", "x"], [{}] * 3)
    assert result.rewards == [101.0, 2.0, 3.0]
    assert [len(r["batch"]) for r in server.requests] == [2, 1]


def test_remote_retries_a_server_error(serve):
    server = serve(fail_first=2)
    scorer = RewardScorer(remote_config(server.url, retries=2))
    assert scorer.score(["abc"], ["x"], [{}]).rewards == [3.0]
    assert len(server.requests) == 3


def test_remote_gives_up_after_the_retries(serve):
    server = serve(fail_first=10)
    scorer = RewardScorer(remote_config(server.url, retries=1, on_error="zero"))
    result = scorer.score(["abc"], ["x"], [{}])
    assert result.rewards == [0.0] and len(server.requests) == 2
    assert "failed after 2 attempts; last error: HTTP 500" in result.errors[0]


def test_remote_batches_stop_at_the_first_failed_request(serve):
    server = serve(fail_first=100, status=400)
    scorer = RewardScorer(remote_config(server.url, batch_size=2))
    with pytest.raises(RewardError, match=f"reward remote {server.url} failed on sample 0"):
        scorer.score(["a", "b", "c", "d", "e"], [None] * 5, [{}] * 5)
    assert len(server.requests) == 1  # the other two batches were never sent


def test_remote_client_error_is_not_retried(serve):
    server = serve(fail_first=1, status=400)
    scorer = RewardScorer(remote_config(server.url, retries=3))
    with pytest.raises(RewardError, match="RemoteRewardError: .* answered HTTP 400") as info:
        scorer.score(["abc"], ["x"], [{}])
    assert isinstance(info.value.cause, RemoteRewardError)
    assert len(server.requests) == 1


def test_remote_missing_field(serve):
    server = serve()
    scorer = RewardScorer(remote_config(server.url, field="reward", on_error="zero"))
    result = scorer.score(["abc"], ["x"], [{}])
    assert "field 'reward' is not a number: None" in result.errors[0]


def test_remote_timeout(serve):
    server = serve(delay=0.5)
    config = remote_config(server.url, timeout_s=0.1, retries=0, on_error="zero")
    result = RewardScorer(config).score(["abc"], ["x"], [{}])
    assert result.num_errors == 1 and "timed out" in result.errors[0]


def test_remote_server_down():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = remote_config(f"http://127.0.0.1:{port}/score", retries=1)
    expected = r"sample 0 \(response 'abc'\): RemoteRewardError: .*failed after 2 attempts"
    with pytest.raises(RewardError, match=expected):
        RewardScorer(config).score(["abc"], ["x"], [{}])
    result = RewardScorer(remote_config(config.remote.url, on_error="zero")).score(
        ["a", "b"], ["x", "y"], [{}, {}]
    )
    assert result.rewards == [0.0, 0.0] and result.num_errors == 2
    assert all("RemoteRewardError" in e for e in result.errors)


def test_remote_metadata_that_json_cannot_hold_goes_as_text(serve):
    server = serve()
    scorer = RewardScorer(remote_config(server.url))
    scorer.score(["abc"], ["abc"], [{"day": datetime.date(2024, 5, 1)}])
    assert server.requests[0]["metadata"] == {"day": "2024-05-01"}


def test_remote_async_scoring_on_one_session(serve):
    server = serve(fail_first=1)
    reward = RemoteReward(server.url, field="score", timeout=5.0, retries=1, backoff=0.01)

    async def scenario():
        async with aiohttp.ClientSession() as session:
            # answered 500 once, then retried
            first = await reward.score_async("abc", "abc", {}, session=session)
            concurrent = await asyncio.gather(
                *(reward.score_async(r, "bb", {}, session=session) for r in ["a", "bb", "ccc"])
            )
            batch = await reward.score_batch_async(["bb", "x"], ["bb", "y"], [{}, {}])
            return first, concurrent, batch

    first, concurrent, batch = asyncio.run(scenario())
    assert first == 103.0 and concurrent == [1.0, 102.0, 3.0] and batch == [102.0, 1.0]
    assert len(server.requests) == 6

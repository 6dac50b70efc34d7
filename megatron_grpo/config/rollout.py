"""The rollout side's sections: sampling, engines, weight sync, tools; prompt data; advantages
(the reward's section is config/reward.py)."""

from __future__ import annotations

import ipaddress
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
class SamplingConfig:
    """How each completion is sampled (sent with every generation request)."""

    temperature: float = 1.0
    """Softmax temperature; 0 is greedy."""
    top_p: float = 1.0
    """Sample from the most likely tokens whose probabilities sum to top_p; 1: all."""
    top_k: int = -1
    """Sample from the k most likely tokens; -1: all."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra stop tokens besides the tokenizer's end of sequence."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"rollout.sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"rollout.sampling.top_k must be -1 (off) or >= 1, got {self.top_k}")


@dataclass(kw_only=True)
class EnginesConfig:
    """Which engines generate, and where they are: started by the trainer or attached to."""

    type: Literal["embedded", "sglang"] = "embedded"
    """The embedded CPU server, or SGLang servers (started from ``launch_command`` or
    attached at ``urls``)."""
    embedded_server: Literal["auto", "thread", "process"] = "auto"
    """type=embedded: serve from a thread of the main rank, or from ``num_servers``
    processes of their own (``python -m megatron_grpo.embedded``, started and
    watched like launched SGLang servers), so that generation runs beside training; auto is
    process when rollout.max_staleness >= 1, else thread."""
    urls: list[str] = field(default_factory=list)
    """SGLang servers (or one sglang-router) to attach to when type=sglang."""
    launch_command: str | None = None
    """Start the SGLang servers from this command template instead of attaching to ``urls``,
    e.g. ``python -m sglang.launch_server --model-path /ckpt --host {host} --port {port}``;
    ``{port}`` is filled per server (also ``{host}``, ``{index}``, ``{model}``: train.init
    when it is a HF directory, else the tokenizer's). Whatever the servers load, the trainer
    sends them the policy's weights before the first rollout."""
    num_servers: int = 1
    """How many servers ``launch_command`` starts, each on a free port (and how many
    embedded server processes)."""
    host: str = "127.0.0.1"
    """Address the servers the trainer starts listen on (``{host}``)."""
    startup_timeout_s: float = 600.0
    """Limit for the started servers to generate (``/health_generate``) and join the
    router; also how long attaching to ``urls`` waits for each server's ``/health``."""
    log_dir: str | None = None
    """Where each started server's log goes; None makes a temporary directory."""
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
    listen beyond loopback (``host``)."""

    def __post_init__(self) -> None:
        if self.num_servers < 1:
            raise ValueError(f"rollout.engines.num_servers must be >= 1, got {self.num_servers}")
        if self.startup_timeout_s <= 0:
            raise ValueError(
                f"rollout.engines.startup_timeout_s must be > 0, got {self.startup_timeout_s}"
            )
        if self.embedded_server != "auto" and self.type != "embedded":
            raise ValueError("rollout.engines.embedded_server is for rollout.engines.type=embedded")
        if self.api_key_env is not None and not self.api_key_env.isidentifier():
            raise ValueError(
                "rollout.engines.api_key_env must name an environment variable (the key "
                f"itself goes in that variable, not in the config), got {self.api_key_env!r}"
            )


@dataclass(kw_only=True)
class EngineClientConfig:
    """How the trainer talks to the engines: requests in flight and how long each may take."""

    max_concurrency: int = 64
    """Generation requests in flight at once, over all engines."""
    request_timeout_s: float = 600.0
    """Limit for one generation; one that runs longer is aborted on its server."""
    connect_timeout_s: float = 10.0
    """Limit for opening a connection to a server (retried like a refusal)."""
    control_timeout_s: float = 60.0
    """Limit for health, pause, abort and info calls."""
    weight_update_timeout_s: float = 600.0
    """Limit for one weight-update call."""

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(
                f"rollout.client.max_concurrency must be >= 1, got {self.max_concurrency}"
            )
        timeouts = (
            "request_timeout_s",
            "connect_timeout_s",
            "control_timeout_s",
            "weight_update_timeout_s",
        )
        for name in timeouts:
            if getattr(self, name) <= 0:
                raise ValueError(f"rollout.client.{name} must be > 0, got {getattr(self, name)}")


@dataclass(kw_only=True)
class WeightSyncConfig:
    """How the policy's weights reach the engines after each step."""

    method: Literal["tensor", "disk", "distributed"] = "tensor"
    """From every pipeline stage's sender: ``tensor`` (an SGLang server: shared memory, so
    senders on its machine) and ``disk`` (``disk_dir`` visible to senders and servers) or
    ``distributed`` (a gloo/nccl broadcast group per stage), which needs neither."""
    master_address: str = "127.0.0.1"
    """The main rank's host as the servers reach it (method=distributed); senders on
    other hosts use their host's address."""
    bucket_mb: int = 512
    """Largest bucket a stage sends at once (a request, a file or a broadcast)."""
    disk_dir: str | None = None
    """method=disk: where each push's directory is made (default: the system's temporary
    directory); each push's directory is removed once the engines loaded it."""
    check: bool | Literal["rows", "checksum"] = False
    """After each push, compare what every engine holds with what was sent, and stop, naming
    the weights, if any differs. ``true`` (or ``rows``): the first rows of every weight, read
    back (``/get_weights_by_name``), equal within bf16 rounding. ``checksum``: a checksum of
    every weight's bytes as sent, against the embedded server's (``/weights_checksum``, not
    an SGLang endpoint); an SGLang engine gets the ``rows`` check instead."""
    delta: bool = False
    """method=tensor, embedded engines only: after the first push, send each tensor as
    ``zstd(new XOR previous bytes)`` with a checksum of the new bytes, skip unchanged ones,
    and push in full what an engine could not apply (``embedded.delta``). Each stage's
    sender keeps a host copy of the bytes it last sent. SGLang has no endpoint that applies
    a delta, so a run with this on is refused at start when an engine answers that it is
    SGLang (``engines.type: sglang`` alone does not say it: embedded servers may be attached
    at ``urls``)."""

    def __post_init__(self) -> None:
        if self.delta and self.method != "tensor":
            raise ValueError(
                f"rollout.sync.delta needs rollout.sync.method: tensor, not {self.method!r} "
                "(the delta is sent to the embedded server's /update_weights_from_delta)"
            )


OFFLOADABLE = ("optimizer", "grads", "params")
"""What of the learner ``rollout.colocate.offload`` may move to host memory while the engines
generate."""


@dataclass(kw_only=True)
class ColocateConfig:
    """``rollout.placement: colocated``: the engines run on the learner's GPUs and the two take
    turns. Each step: the learner's ``offload`` goes to host memory -> the engines' weights
    wake -> the new weights are pushed -> their KV cache and CUDA graphs wake -> they
    generate -> they release their memory -> the learner comes back -> it trains
    (``train.colocation``)."""

    offload: list[Literal["optimizer", "grads", "params"]] = field(
        default_factory=lambda: ["optimizer", "grads"]
    )
    """What of the learner goes to host memory while the engines generate: its optimizer
    states, its gradient buffers, its parameters (after the weight push, which reads them).
    slime's ``--offload-train`` moves all three; verl's ``optimizer_offload`` and
    ``param_offload``."""
    mem_fraction_static: float = 0.7
    """The share of each GPU an engine the trainer launches may take for its weights and KV
    cache while awake (SGLang's ``--mem-fraction-static``); what the learner keeps resident
    (parameters not offloaded, its CUDA context) must fit beside it."""
    engine_tp: int | None = None
    """GPUs per engine (SGLang's ``--tp-size``) when the trainer launches them; one engine per
    ``engine_tp`` GPUs of each node. None: the smallest power of two whose weight shard takes
    at most half of ``mem_fraction_static`` of a GPU (``dry-run`` prints it)."""
    transition_timeout_s: float = 300.0
    """How long each transition (a release, a resume, an offload, a reload) may take before
    the run stops naming it."""
    host_memory_headroom_gib: float = 8.0
    """Host memory (per node) that the offload must leave free for everything else: the
    run refuses at start when the node's available memory minus this cannot hold what all
    its ranks offload."""

    def __post_init__(self) -> None:
        unknown = [o for o in self.offload if o not in OFFLOADABLE]
        if unknown:
            raise ValueError(
                f"rollout.colocate.offload takes {', '.join(OFFLOADABLE)}; got {unknown}"
            )
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                "rollout.colocate.mem_fraction_static must be in (0, 1), got "
                f"{self.mem_fraction_static}"
            )
        if self.engine_tp is not None and (
            self.engine_tp < 1 or self.engine_tp & (self.engine_tp - 1)
        ):
            raise ValueError(
                f"rollout.colocate.engine_tp must be a power of two >= 1, got {self.engine_tp}"
            )
        if self.transition_timeout_s <= 0:
            raise ValueError(
                "rollout.colocate.transition_timeout_s must be > 0, got "
                f"{self.transition_timeout_s}"
            )
        if self.host_memory_headroom_gib < 0:
            raise ValueError(
                "rollout.colocate.host_memory_headroom_gib must be >= 0, got "
                f"{self.host_memory_headroom_gib}"
            )


@dataclass(kw_only=True)
class RolloutConfig:
    """Where generations come from and how they are sampled.

    The batch's shape (``prompts_per_step``, ``samples_per_prompt``, ``max_new_tokens``) is
    here, as verl's ``arr.rollout.n`` and ``response_length`` and slime's
    ``--rollout-batch-size``, ``--n-samples-per-prompt`` and ``--rollout-max-response-len``
    are rollout options; the sections below it hold the per-request sampling, the engines,
    the client that talks to them, and the weight sync."""

    prompts_per_step: int = 8
    """Prompt groups per RL step."""
    samples_per_prompt: int = 4
    """Completions per prompt (the GRPO group size)."""
    max_new_tokens: int = 64
    """Generation budget per completion (also Dr. GRPO's default L)."""
    mask_truncated: bool = False
    """Give completions cut by max_new_tokens no loss tokens (overlong filtering)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    client: EngineClientConfig = field(default_factory=EngineClientConfig)
    sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    placement: Literal["disaggregated", "colocated"] = "disaggregated"
    """Where the engines run: on GPUs of their own (``disaggregated``), or on the learner's,
    taking turns with it (``colocated``: ``rollout.colocate``; verl's hybrid engine, slime's
    ``--colocate``, NeMo-RL's ``policy.generation.colocated.enabled``)."""
    colocate: ColocateConfig = field(default_factory=ColocateConfig)
    max_staleness: int = 0
    """0: each step generates its rollout, then trains on it (synchronous). k >= 1: the
    rollouts of the next steps are generated while the learner trains (asynchronous), each
    by a policy at most k weight versions older than the one it trains; samples a weight
    update interrupts go on under the new weights (partial rollouts)."""
    producer_cpus: list[int] = field(default_factory=list)
    """max_staleness >= 1: the CPU cores the rollout producer's process runs on (its HTTP
    client, decoding, rewards, advantages), e.g. the rollout side's rather than the
    learner's; empty: the trainer's."""
    return_routed_experts: bool | None = None
    """Ask the engines for the experts they routed each token to (SGLang's
    ``return_routed_experts``; its servers need ``--enable-return-routed-experts``, which
    the trainer passes to those it launches): rollout routing replay (R3) replays them, and
    the learner logs how often its own routers agree (``router_agreement``). None (the
    default): when ``train.routing_replay`` is r3, set when the config is built."""
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
        if self.engines.type != "embedded":
            return False
        if self.engines.embedded_server == "auto":
            return self.max_staleness > 0 or self.placement == "colocated"
        return self.engines.embedded_server == "process"

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness must be >= 0, got {self.max_staleness}")
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
        engines = self.engines
        if self.placement == "colocated":
            self._check_colocated()
        if self.embedded_process and engines.api_key_env is None and not is_loopback(engines.host):
            raise ValueError(
                f"rollout.engines.host={engines.host!r} is beyond loopback: the embedded "
                "servers there need an API key (their --api-key); set "
                "rollout.engines.api_key_env to the name of an environment variable holding it"
            )
        if self.hook is not None and self.hook != "tools":
            module, sep, name = self.hook.partition(":")
            if not (module and sep and name):
                raise ValueError(
                    f"rollout.hook must be 'tools' or 'package.module:function', got {self.hook!r}"
                )
        if engines.type == "sglang" and self.replay_dir is None:
            if not engines.urls and not engines.launch_command:
                raise ValueError(
                    "rollout.engines.type=sglang needs rollout.engines.urls or "
                    "rollout.engines.launch_command"
                )
            if engines.urls and engines.launch_command:
                raise ValueError(
                    "set rollout.engines.urls (attach) or rollout.engines.launch_command, not both"
                )

    def _check_colocated(self) -> None:
        if self.max_staleness:
            raise ValueError(
                "rollout.placement: colocated with rollout.max_staleness >= 1: asynchronous "
                "RL generates while the learner trains, and colocated engines and learner "
                "take turns on the same GPUs; use one or the other"
            )
        if self.engines.type == "embedded" and self.engines.embedded_server == "thread":
            raise ValueError(
                "rollout.placement: colocated with rollout.engines.embedded_server: thread: "
                "the embedded engine releases and resumes its memory as a process of its own "
                "(embedded_server: process or auto)"
            )
        if self.engines.type == "sglang" and self.engines.router_url is not None:
            raise ValueError(
                "rollout.placement: colocated with rollout.engines.router_url: each engine "
                "is put to sleep and woken by the trainer, not through a router"
            )
        if (
            self.engines.type == "sglang"
            and self.engines.launch_command
            and (self.engines.num_servers != 1)
        ):
            raise ValueError(
                "rollout.placement: colocated launches one engine per rollout.colocate."
                "engine_tp GPUs of the node; rollout.engines.num_servers is not used there "
                f"(got {self.engines.num_servers})"
            )
        if self.sync.method == "disk":
            raise ValueError(
                "rollout.placement: colocated pushes weights by tensor (CUDA IPC handles on "
                "the shared GPUs) or distributed, not rollout.sync.method: disk"
            )


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
    when the config is built (the resolved config shows it); unset with
    ``rollout.replay_dir``, which reads no prompts."""
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

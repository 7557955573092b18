"""The job spec's sections: small `kw_only` dataclasses whose fields carry their docs,
and `JobConfig`, the whole spec with what follows from it (data-parallel size and
rank, tokens per sample, accumulation steps)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trainstack.dims import ParallelDims


@dataclass(kw_only=True)
class MoEConfig:
    """GPT: mixture-of-experts layers in place of dense MLPs (models/moe.py)."""

    experts: int = 0
    """Experts per MoE layer (>= 2); 0: every block keeps its dense MLP."""
    top_k: int = 2
    """Experts each token is routed to (1 to experts)."""
    every: int = 1
    """Every this many blocks is an MoE block (the last of each run of `every`)."""
    expert_hidden: int = 0
    """Each expert's hidden width; 0: 4 × n_embd, as the dense MLP."""
    capacity_factor: float = 0.0
    """Each expert takes at most ceil(f × tokens × top_k / experts) of a rank's tokens per
    forward, the rest dropped (counted); 0: no limit, nothing dropped."""
    balance: str = "aux_loss"
    """`aux_loss` (Switch/GShard auxiliary loss × aux_weight), `bias` (aux-loss-free:
    a per-expert routing bias moved toward even loads each step) or `none`."""
    aux_weight: float = 0.01
    """balance aux_loss: the auxiliary loss's weight in the training loss (>= 0)."""
    bias_rate: float = 1e-3
    """balance bias: how far each step moves an expert's bias (>= 0)."""


@dataclass(kw_only=True)
class LoRAConfig:
    """Low-rank adapters (LoRA, by `peft`): the model's weights stay frozen and each
    targeted linear layer `W` trains `W + (alpha / rank) · B·A` (A: rank × in, B: out ×
    rank, B starting at zero, so training starts from the model's own outputs)."""

    rank: int = 0
    """The adapters' rank r (>= 1); 0, the default: no adapters, every weight trains."""
    alpha: int = 16
    """The scale's numerator: the adapters' output is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1)."""
    target_modules: tuple[str, ...] = ()
    """Names of the linear layers to adapt: a module matches when its name ends with one
    of them (`q_proj` adapts every block's attention query). Empty: the attention's query
    and value projections, as `peft` picks for a Hugging Face family, `q_proj` and
    `v_proj` for trainstack's GPT; a custom model names its own."""


@dataclass(kw_only=True)
class ModelConfig:
    kind: str = "gpt"
    """`gpt` (decoder-only transformer), `mlp` (windowed next-token MLP), `custom` (your
    own module, named by `target`) or `hf` (a Hugging Face causal LM built from `hf`)."""
    target: str = ""
    """custom: `package.module:attribute`, an `nn.Module` class or a factory returning one."""
    args: dict[str, Any] = field(default_factory=dict)
    """custom: keyword arguments `target` is called with."""
    hf: dict[str, Any] = field(default_factory=dict)
    """hf: the model's Hugging Face config keys, `model_type` first (e.g. `llama`, `gpt2`);
    `vocab_size` follows data.vocab_size. Randomly initialised: nothing is downloaded."""
    pretrained: str = ""
    """hf: a local `save_pretrained` directory to start from (weights from local disk only)."""
    checkpoint_modules: tuple[str, ...] = ()
    """Class names of the blocks that `activation_checkpointing` wraps (custom and hf
    models); empty: the model's pipeline layers, or the HF family's decoder layer."""
    n_layer: int = 2
    """GPT: transformer blocks. MLP: hidden layers."""
    n_head: int = 2
    """GPT: attention heads; must divide `n_embd`."""
    n_embd: int = 64
    """Width: GPT embedding size, MLP hidden size."""
    block_size: int = 64
    """Sequence length the model is trained on (tokens per sample)."""
    dropout: float = 0.0
    """Dropout probability in [0, 1)."""
    context: int = 4
    """MLP only: how many previous tokens each prediction sees."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass instead of keeping them."""
    fused_loss: bool = False
    """gpt, task lm: the LM head and the cross-entropy computed together, the [B, T, V]
    logits never held whole (Liger's fused kernel on a GPU where liger-kernel is
    installed, chunks of the tokens elsewhere): the logits' memory is freed for a larger
    micro-batch."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """GPT: mixture-of-experts blocks (`experts: 0`, the default: none)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters in place of training every weight (`rank: 0`, the default: none)."""


@dataclass(kw_only=True)
class TaskConfig:
    kind: str = "lm"
    """`lm`: token ids [B, T] -> logits [B, T, V], next-token cross-entropy; `classify`:
    inputs -> logits [B, C], cross-entropy and accuracy; `dpo`: preference pairs
    (`data.kind: preference`), direct preference optimisation against the model with its
    LoRA adapters off (`dpo`)."""
    loss: str = ""
    """Optional `package.module:function` called as `fn(outputs, batch) -> scalar tensor`
    (batch = (inputs, targets)) instead of the task's cross-entropy."""


@dataclass(kw_only=True)
class DPOConfig:
    """`task.kind: dpo`: how the policy's preference for the chosen answer over the
    rejected one is trained, against the reference (the model with its adapters off)."""

    beta: float = 0.1
    """β: how far the policy may move from the reference (> 0); rewards are β × the
    log-probability ratio of policy to reference."""
    loss: str = "sigmoid"
    """`sigmoid` (DPO: −log σ(β·h), h the chosen's log-ratio minus the rejected's) or `ipo`
    ((h − 1/(2β))², h from the answers' mean log-probabilities per token)."""


@dataclass(kw_only=True)
class DataConfig:
    kind: str = "markov"
    """Data source. Synthetic: `markov` (Markov-chain text with an exact entropy floor,
    for `lm`), `clusters` (labelled inputs with a known Bayes accuracy, for `classify`).
    Yours: `tokens` (flat token files), `text` (text files and a tokenizer), `arrays`
    (.npz/.npy inputs and labels), `ray` (a Ray Data dataset), `custom` (a map-style
    torch Dataset named by `target`)."""
    train: tuple[str, ...] = ()
    """tokens, text, chat, arrays, ray: training files, paths or globs (relative to the working
    directory): a list, or one path or glob."""
    val: tuple[str, ...] = ()
    """tokens, text, chat, arrays, ray: held-out files, paths or globs (a list, or one);
    empty: `val_fraction`."""
    val_fraction: float = 0.0
    """Without `val`: the fraction of the training samples (text: of its files) held out,
    in [0, 0.5)."""
    tokenizer: str = "bytes"
    """text: `bytes` (vocabulary 256, no files) or a Hugging Face `tokenizers` JSON file;
    chat: a Hugging Face tokenizer folder (a pretrained model's)."""
    chat_template: str = ""
    """chat: a Jinja chat-template file to render conversations with; empty: the
    tokenizer's own."""
    truncate: bool = False
    """chat: cut a conversation longer than model.block_size + 1 tokens to that length
    (false: refuse it, naming file:line)."""
    pack: bool = False
    """chat: pack whole conversations, in file order, into samples of model.block_size
    tokens, each conversation with its own position ids (from 0) and attending only to
    itself (false: one conversation a sample, padded). For model.kind hf (a family that
    runs its own forward) on a layout that is not a pipeline."""
    prepared_dir: str = ""
    """text: where `trainstack prepare` writes token files; empty:
    `<checkpoint.storage_path>/prepared/<fingerprint>`. Never the user's data directory."""
    token_dtype: str = "auto"
    """tokens: `auto` (from the llm.c header, else uint16), `uint16` or `uint32`."""
    inputs_key: str = "inputs"
    """arrays: the .npz key (or .npy file stem) of the inputs."""
    labels_key: str = "labels"
    """arrays: the .npz key (or .npy file stem) of the labels."""
    format: str = "parquet"
    """ray: the reader for `train`/`val`: `parquet`, `json` (JSON lines) or `text`."""
    column: str = "tokens"
    """ray: the column holding each row's `model.block_size + 1` token ids (lm)."""
    target: str = ""
    """custom: `package.module:attribute` returning a map-style torch Dataset of
    (inputs, target) items; ray: a function returning a `ray.data.Dataset`."""
    args: dict[str, Any] = field(default_factory=dict)
    """custom, ray: keyword arguments `target` is called with."""
    shuffle: bool = True
    """Indexed sources: read each epoch in a permutation seeded by (`seed`, epoch)."""
    allow_changed: bool = False
    """Resume even if the data's fingerprint (or another `data` key) differs from the
    checkpoint's."""
    vocab_size: int = 64
    """Tokens in the vocabulary (2 to 2**22; markov: vocab_size**order at most 2**20); the
    model's vocabulary follows it."""
    order: int = 1
    """Markov order: how many previous tokens the next one depends on (1..3)."""
    concentration: float = 0.1
    """Dirichlet concentration of each transition row; smaller is more predictable (> 0)."""
    seed: int = 1234
    """Seed of the transition matrix and of the sample stream (independent of train.seed)."""
    eval_samples: int = 256
    """Held-out samples for the evaluation loss (>= 0; 0 disables evaluation)."""
    num_classes: int = 10
    """clusters: classes (2..1000); the model's output width for `task.kind: classify`."""
    shape: tuple[int, ...] = (1, 8, 8)
    """clusters: shape of one input, e.g. [1, 8, 8] (an image) or [16] (a vector)."""
    noise: float = 1.0
    """clusters: standard deviation of the Gaussian noise around each class's template (> 0)."""


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 200
    """Optimizer steps to run (>= 1)."""
    global_batch_size: int = 32
    """Samples per optimizer step over all workers and accumulation micro-steps."""
    micro_batch_size: int = 8
    """Samples per forward/backward on one worker."""
    seed: int = 0
    """Seed of model initialisation (same on every rank) and dropout."""
    precision: str = "fp32"
    """`fp32`, `bf16` autocast (GPU, or CPU where supported), or `fp64`: weights,
    activations, gradients and collectives in float64, for numerics checks (the suite
    compares layouts with one process this way, so the bound holds on any CPU). fp64
    runs on the torch engines (ddp, fsdp, tensor parallel, pipeline engine torch)."""
    compile: bool = False
    """torch.compile each repeated block (a GPT's blocks, `model.checkpoint_modules`), as
    torchtitan does: after tensor parallelism and activation checkpointing, before
    FSDP. The first step pays the compilation (seconds to minutes)."""
    pin_memory: bool = True
    """On a GPU: batches go to page-locked host memory and are copied to the device
    without blocking the host. No effect on CPU."""


@dataclass(kw_only=True)
class OptimConfig:
    kind: str = "adamw"
    """`adamw` or `sgd`."""
    lr: float = 3e-3
    """Peak learning rate (> 0), before `lr_scaling`."""
    weight_decay: float = 0.0
    """Decoupled weight decay (>= 0)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas, each in [0, 1)."""
    momentum: float = 0.9
    """SGD momentum in [0, 1)."""
    warmup_steps: int = 10
    """Linear warm-up steps (>= 0, < train.steps)."""
    schedule: str = "cosine"
    """After warm-up: `cosine` (to `min_lr_ratio` × lr), `linear`, or `constant`."""
    min_lr_ratio: float = 0.1
    """Floor of the decay as a fraction of the peak lr, in [0, 1]."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (> 0); 0 disables clipping."""
    lr_scaling: str = "none"
    """Scale lr with world size: `none`, `linear` (× N) or `sqrt` (× √N)."""
    fused: bool = True
    """On a GPU, the optimizer's fused kernel (every parameter's update in one launch);
    false, or on CPU: torch's multi-tensor (foreach) update."""


@dataclass(kw_only=True)
class StrategyConfig:
    kind: str = "ddp"
    """Parallelism strategy: `ddp`, `zero` (DeepSpeed ZeRO), `fsdp` (FSDP2 with tensor
    parallelism on one device mesh), `pipeline`, `ps` (parameter server), or `auto` (the
    layout `trainstack plan` recommends for scaling.num_workers devices, chosen at
    launch)."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB (> 0)."""
    gradient_as_bucket_view: bool = False
    """DDP: gradients are views into the all-reduce buckets (one copy fewer, a model's
    worth of gradient memory less)."""
    stage: int = 2
    """zero: ZeRO stage 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters) sharded."""
    offload_optimizer: str = "none"
    """zero: `none` or `cpu` (optimizer state and step on the host; DeepSpeed's CPU Adam)."""
    offload_param: str = "none"
    """zero (stage 3) and fsdp: `none` or `cpu` (parameters on the host between uses; fsdp
    also keeps gradients there and steps the optimizer on the host)."""
    overlap_comm: bool = False
    """zero: overlap gradient reduction with the backward pass."""
    reduce_bucket_size: int = 500_000_000
    """zero: elements per gradient reduction bucket (> 0)."""
    stages: int = 2
    """pipeline: pipeline ranks p (>= 2); the model is cut into p × virtual_stages stages."""
    schedule: str = "1f1b"
    """pipeline: `gpipe`, `1f1b`, `interleaved`, `zb_interleaved`, `zbv` or `dualpipev`."""
    microbatches: int = 4
    """pipeline: micro-batches per step per pipeline; train.micro_batch_size is
    global_batch_size / (data_parallel × microbatches)."""
    virtual_stages: int = 0
    """pipeline: stages per rank; 0 picks the schedule's own (1 for gpipe and 1f1b, else 2)."""
    data_parallel: int = 1
    """pipeline: pipeline replicas d; scaling.num_workers must be stages × data_parallel
    × tensor_parallel."""
    tensor_parallel: int = 1
    """fsdp, and pipeline (torch engine, GPT): tensor-parallel degree t (Megatron-style
    column/row-parallel attention and MLP, sequence-parallel norms); must divide the
    heads, the width, the vocabulary and the sequence."""
    context_parallel: int = 1
    """fsdp (GPT): context-parallel degree c: each of c ranks holds 1/c of every row's
    tokens (an early and a late chunk) and attention runs as a ring over them
    (`strategies/context_parallel.py`); `model.block_size` divisible by 2c. The shard
    degree is scaling.num_workers / c: FSDP shards over the data- and context-parallel
    ranks alike."""
    data_parallel_replicate: int = 1
    """fsdp: replica groups r (HSDP: parameters sharded within a group, replicated across
    groups); the shard degree is scaling.num_workers / (r × tensor_parallel). pipeline
    with shard_replicas: the d replicas form r groups, each sharding the stages d / r
    ways."""
    reshard_after_forward: bool = True
    """fsdp: free gathered parameters after each block's forward (ZeRO-3-like); false keeps
    them until the backward (ZeRO-2-like: more memory, one all-gather less)."""
    loss_parallel: bool = True
    """fsdp with tensor_parallel > 1: cross-entropy on vocabulary-sharded logits, never
    gathering the full [B, T, V] logits."""
    shard_replicas: bool = False
    """pipeline (torch engine): shard each stage's parameters, gradients and optimizer state
    over the data_parallel replicas with FSDP2 (gathered for the stage's compute) instead of
    replicating them and all-reducing gradients."""
    engine: str = "torch"
    """pipeline: `torch` (torch.distributed.pipelining) or `deepspeed` (its PipelineEngine)."""
    allreduce: str = "flat"
    """ddp: `flat` (DDP's all-reduce over every rank), `hierarchical` (within each node,
    then one rank per node across nodes, then back: the inter-node link carries one copy
    per node; a `compression:` kind compresses that level only) or `auto` (where the ranks
    span several nodes and share some: times each level's link at start and takes two
    levels when the α-β model says they are faster)."""
    expert_parallel: int = 1
    """ddp with MoE layers: ranks P that split each layer's experts (E / P each), tokens
    sent to their experts' ranks by all-to-all; must divide scaling.num_workers and the
    experts. 1: every rank holds every expert."""
    num_shards: int = 2
    """ps: parameter-server shard actors (1 to the model's parameter tensors)."""
    consistency: str = "async"
    """ps: `async` (no waiting), `ssp` (bounded staleness) or `bsp` (synchronous rounds)."""
    staleness_bound: int = 0
    """ps: with ssp, clocks a worker may run ahead of the slowest; with
    reject_beyond_bound, the largest staleness (in shard updates) a push may have."""
    staleness_lr: str = "none"
    """ps: `none`, or `inverse`: a push is applied with lr / (1 + staleness_alpha × staleness)."""
    staleness_alpha: float = 1.0
    """ps: the `a` of the inverse staleness lr (>= 0)."""
    reject_beyond_bound: bool = False
    """ps: drop (and count) pushes whose staleness exceeds staleness_bound."""
    pull_every: int = 1
    """ps: steps between a worker's parameter pulls (>= 1)."""
    checkpoint_every_updates: int = 50
    """ps: each shard saves its parameters, optimizer state and clock every this many updates."""
    ps_cpus: float = -1.0
    """ps: CPUs each shard actor reserves (>= 0), or -1 (auto): 0 when Ray runs on one
    machine (an embedded local instance: the shards fit beside the workers, as before),
    1 when the cluster has more than one node."""
    local_servers: str = "none"
    """ps: `none` (workers push to and pull from the global shards), `per_node` (a local
    server on each node the workers landed on, for that node's workers) or a count N
    (N local servers, worker w with server w mod N). A local server sums its workers'
    pushes and sends the global shards one update for several of them."""
    sync_every: int = 1
    """ps with local servers, async and ssp: worker pushes a local server sums before it
    sends their mean to the global shards as one update (and takes their parameters
    back); bsp sends once per clock, when every worker of the server has pushed it."""
    max_local_staleness: int = 0
    """ps with local servers: clocks a local server's copy of the parameters may lag the
    worker pulling it before the server syncs with the global shards first (>= 0)."""


@dataclass(kw_only=True)
class CompressionConfig:
    kind: str = "none"
    """Gradient compression: `none`, `fp16`, `bf16`, `topk`, `randk`, `qsgd`, `sign`,
    `powersgd`, or `auto` (DDP: top-k whose ratio, or dense, follows the measured
    network; docs/compression.md, "Adaptive compression")."""
    ratio: float = 0.01
    """topk, randk: fraction of each tensor's coordinates sent, in (0, 1]; auto: the
    sparsest ratio it may choose (of 0.1, 0.01, 0.001)."""
    bits: int = 8
    """qsgd: bits per coordinate on the wire, 2, 4 or 8."""
    rank: int = 4
    """powersgd: rank of the low-rank approximation (>= 1)."""
    error_feedback: bool = True
    """Add each rank's residual g - C(g) to its next gradient (randk then sends unscaled values)."""
    min_numel: int = 1024
    """Tensors with fewer elements than this go dense (fp32 all-reduce), >= 0."""
    warmup_steps: int = 0
    """Compression warm-up (>= 0, < train.steps; lossy kinds under DDP): topk/randk
    ramp their ratio exponentially from 1 (dense) to `ratio` over this many steps; the
    other lossy kinds send fp32 until it ends. Warm-up bytes count in the run's ratio."""
    momentum_correction: bool = True
    """DDP, lossy kinds: keep the optimizer's moments on each rank and compress the
    update they give (AdamW's m/(sqrt(v)+eps), SGD's momentum: Deep Gradient
    Compression's momentum correction) instead of the raw gradient; the optimizer then
    applies the averaged update with lr and weight decay alone, and each rank clips its
    own gradient to optim.grad_clip first. On the demo job it brings top-k 1% from 11.7%
    to 2.8% above dense DDP's loss (docs/compression.md); false compresses
    the raw gradient. Parameter-server pushes always send gradients."""
    auto_link_gbit: float = 0.0
    """kind auto: model the link as this many Gbit/s (latency 10 µs) instead of timing
    all-reduces (0: measure), e.g. for a network the first steps do not show."""
    local_clip: bool = False
    """Clip each rank's gradient to optim.grad_clip before compression (per tensor, to
    its share sqrt(n_i / n) of the bound); always on with momentum_correction."""


@dataclass(kw_only=True)
class ScalingConfig:
    num_workers: int = 2
    """Training workers (Ray Train actors), >= 1."""
    use_gpu: bool = False
    """One GPU per worker (NCCL) instead of CPU (gloo)."""
    cpus_per_worker: float = 1.0
    """CPUs reserved per worker (> 0); also its torch thread count, rounded down, min 1."""
    start_timeout_s: float = 600.0
    """On a cluster: seconds one start attempt of the worker group waits for room (0:
    forever); attempts that time out or fail are retried up to `failure.max_failures`
    times, then the run fails. A local Ray instance that can never hold them is refused
    at once."""
    min_workers: int = 0
    """Elastic scaling: the fewest workers the run trains with (0: a fixed group of
    `num_workers`). The spec may write `num_workers: {min: 2, max: 4}` for this and
    `num_workers: 4`. The run starts once `min` fit, grows to `num_workers` as nodes join
    and shrinks as they leave, restarting from the newest checkpoint on every resize."""
    resize_check_s: float = 60.0
    """Elastic scaling: seconds between the checks for room to grow a running group."""
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each worker needs besides its CPUs (and GPU), e.g.
    `{trainstack_worker_node: 1}` to train only on the nodes that advertise it."""
    device_memory: str = ""
    """Memory of one worker's device for the plan (`strategy.kind: auto`, the pre-flight
    memory check, `trainstack plan`), e.g. `80GB` or `16GiB`; empty: the local GPU's,
    else this machine's memory divided among the workers."""

    @property
    def elastic(self) -> bool:
        return self.min_workers > 0

    @property
    def torch_threads(self) -> int:
        """Intra-op threads per worker: the CPUs it reserved, at least one."""
        return max(1, math.floor(self.cpus_per_worker))


@dataclass(kw_only=True)
class CheckpointConfig:
    every_steps: int = 0
    """Save a checkpoint every this many steps (0: only at the end)."""
    keep: int = 3
    """Newest checkpoints that verify kept (>= 1); older ones are deleted."""
    storage_path: str = "runs"
    """Where runs keep checkpoints and results: a path (relative ones are under the working
    dir; on a cluster, one every node mounts) or an object store, `s3://bucket/prefix`,
    `gs://bucket/prefix` (any store `pyarrow.fs` opens). With a store, the run's local files
    (tracking record, fault markers) go to `.cache/trainstack/runs/<name>`."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Options of the store's pyarrow filesystem (`pyarrow.fs.S3FileSystem(**options)`:
    `endpoint_override`, `region`, `scheme`, ...). Never credentials: those come from the
    environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)."""
    on_corrupt: str = "fail"
    """When checkpoints exist but none verifies: `fail` (stop with an error) or `restart`."""
    async_save: bool = True
    """Write checkpoints in the background: each rank copies its state to host memory and
    trains on while a thread of its own writes, hashes and commits it (the manifest only
    once every rank's files landed). At most one save is in flight; the next waits for it.
    false: the step waits for the whole write, as before."""


@dataclass(kw_only=True)
class FailureConfig:
    max_failures: int = 0
    """Worker-group restarts allowed before the run fails (>= 0; -1: unlimited)."""
    health_check_s: float = 0.25
    """How often Ray Train's controller polls the worker group, in seconds (Ray's
    `RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`, whose default is 2). The controller takes each
    checkpoint's report, sees the run end and sees a worker fail at that pace. Each poll
    asks every worker once, so a group of hundreds may want a longer interval."""


@dataclass(kw_only=True)
class FaultsConfig:
    """For testing recovery only, off by default: workers killed on purpose."""

    kill_at_steps: tuple[int, ...] = ()
    """Steps (1-based) just before which a worker process dies, each at most once per run."""
    random_kills: int = 0
    """Further kills at steps drawn from `seed`, in [2, train.steps]."""
    rank: int = -1
    """Rank that dies; -1 draws one per kill from `seed`."""
    seed: int = 0
    """Seed of the random kill steps and ranks."""
    kill_shard_at_updates: tuple[int, ...] = ()
    """ps: updates (1-based) of shard `shard` just before which that shard actor dies."""
    shard: int = 0
    """ps: the shard that `kill_shard_at_updates` kills."""
    slow_rank: int = -1
    """ps: a worker made `slow_factor` times slower by sleeping after each step (-1: none)."""
    slow_factor: float = 1.0
    """ps: how many times slower `slow_rank` runs (>= 1)."""
    step_delay_s: float = 0.0
    """Every training worker sleeps this long before each step, as a larger
    model would take, so a test can act on the cluster while the run is mid-way."""
    mid_save: bool = False
    """A planned kill fires while the checkpoint saved before it is still being written
    in the background (the dying rank's writer holds before it commits), not once it has
    landed: the rerun must resume from the checkpoint before that one."""


@dataclass(kw_only=True)
class TrackingConfig:
    backend: str = "none"
    """`mlflow` or `none`."""
    uri: str = ""
    """MLflow tracking URI; empty means $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db."""
    experiment: str = "trainstack"
    """MLflow experiment name."""


@dataclass(kw_only=True)
class LogConfig:
    every_steps: int = 10
    """Log metrics every this many steps (>= 1)."""
    eval_every_steps: int = 0
    """Also log the held-out loss (`eval_loss`) every this many steps: 0 (only at the
    end) or a multiple of `every_steps`. Sweeps use it to compare trials early."""
    progress: str = "auto"
    """Console progress: `auto` (bar on a TTY, else lines), `bar`, `lines`, `jsonl` or `quiet`."""


@dataclass(kw_only=True)
class JobConfig:
    name: str = "trainstack-job"
    """Run name: letters, digits, '-', '_' and '.'; names the run's storage directory."""
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    deepspeed: dict[str, Any] = field(default_factory=dict)
    """zero only, for experts: raw DeepSpeed config keys, merged over what trainstack derives."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def dims(self) -> ParallelDims:
        """Where the strategy puts each of the `scaling.num_workers` ranks."""
        return ParallelDims.of(self)

    @property
    def data_parallel_size(self) -> int:
        """Model replicas that each see their own share of a step's samples."""
        return self.dims.dp

    def data_parallel_rank(self, rank: int) -> int:
        """The replica (data-parallel rank) that global `rank` belongs to: the ranks of one
        pipeline and of one tensor-parallel group see the same samples."""
        return self.dims.coords(rank).dp

    @property
    def tokens_per_sample(self) -> int:
        """Tokens one sample trains on: the sequence length for `lm`, twice it for `dpo`
        (a pair), 1 for `classify` (throughput and MFU then count samples)."""
        per_kind = {"lm": self.model.block_size, "dpo": 2 * self.model.block_size}
        return per_kind.get(self.task.kind, 1)

    @property
    def frozen_reference(self) -> bool:
        """DPO without `model.lora`: a frozen copy of the model as it starts is its
        reference, held beside the policy (with LoRA: the model with its adapters off)."""
        return self.task.kind == "dpo" and not self.model.lora.rank

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each replica (pipeline: its micro-batches)."""
        per_step = self.train.micro_batch_size * self.data_parallel_size
        return self.train.global_batch_size // per_step

    @property
    def pipeline_virtual_stages(self) -> int:
        """Stages per pipeline rank, with `strategy.virtual_stages: 0` resolved."""
        s = self.strategy
        if s.virtual_stages:
            return s.virtual_stages
        return 1 if s.schedule in ("gpipe", "1f1b") else 2


# ---- loading and overrides ------------------------------------------------------


# ---- dict <-> dataclasses ----------------------------------------------------------

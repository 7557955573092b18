"""The values and limits the job spec allows (the kinds come from `trainstack.kinds`)."""

from __future__ import annotations

import re

from trainstack.kinds import DATA_KINDS as DATA_KIND_TABLE
from trainstack.kinds import KINDS
from trainstack.kinds import MODEL_KINDS as MODEL_KIND_TABLE

MODEL_KINDS: tuple[str, ...] = tuple(MODEL_KIND_TABLE)


BUILTIN_MODEL_KINDS: tuple[str, ...] = tuple(k.name for k in MODEL_KIND_TABLE.values() if k.builtin)
"""Models whose structure the spec alone determines; the others are built to be known."""


TASK_KINDS: tuple[str, ...] = ("lm", "classify", "dpo")
DPO_LOSSES: tuple[str, ...] = ("sigmoid", "ipo")


DATA_KINDS: tuple[str, ...] = tuple(DATA_KIND_TABLE)


DATA_TASKS: dict[str, str] = {k.name: k.task for k in DATA_KIND_TABLE.values() if k.task}
"""The task each data source's samples are for (custom serves either)."""


TOKEN_DTYPES: tuple[str, ...] = ("auto", "uint16", "uint32")


RAY_FORMATS: tuple[str, ...] = ("parquet", "json", "text")


IMPORT_PATH = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")
"""`package.module:attribute`, the form of model.target and task.loss."""


MAX_CLASSES = 1000


MAX_INPUT_NUMEL = 2**20


MAX_TEMPLATE_NUMEL = 2**25
"""clusters: class templates are held whole (float64), so classes × input size is bounded."""


PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp64")


OPTIM_KINDS: tuple[str, ...] = ("adamw", "sgd")


LR_SCHEDULES: tuple[str, ...] = ("cosine", "linear", "constant")


LR_SCALINGS: tuple[str, ...] = ("none", "linear", "sqrt")


STRATEGY_KINDS: tuple[str, ...] = tuple(KINDS)


PS_CONSISTENCY: tuple[str, ...] = ("async", "ssp", "bsp")


PS_STALENESS_LR: tuple[str, ...] = ("none", "inverse")


PS_LOCAL_SERVERS = "none, per_node or a count >= 1"
"""strategy.local_servers: where a ps job's workers push."""


ALLREDUCE_MODES: tuple[str, ...] = ("flat", "hierarchical", "auto")
"""strategy.allreduce: how DDP reduces gradients across nodes."""

MOE_BALANCE: tuple[str, ...] = ("aux_loss", "bias", "none")
"""model.moe.balance: how the experts' loads are kept even."""

PIPELINE_SCHEDULES: tuple[str, ...] = (
    "gpipe",
    "1f1b",
    "interleaved",
    "zb_interleaved",
    "zbv",
    "dualpipev",
)


PIPELINE_ENGINES: tuple[str, ...] = ("torch", "deepspeed")


COMPRESSION_KINDS: tuple[str, ...] = (
    "none",
    "fp16",
    "bf16",
    "topk",
    "randk",
    "qsgd",
    "sign",
    "powersgd",
    "auto",
)


QSGD_BITS: tuple[int, ...] = (2, 4, 8)


OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu")


# Top-level keys DeepSpeed 0.19.8 reads from its config, collected once from its
# source: every key `DeepSpeedConfig._initialize_params` (deepspeed/runtime/config.py,
# constants in deepspeed/runtime/constants.py) and its sub-configs look up, plus the
# ones `deepspeed.initialize` reads (data_parallel_size, sequence_parallel_size).
DEEPSPEED_CONFIG_KEYS: tuple[str, ...] = (
    "activation_checkpointing",
    "aio",
    "amp",
    "autotuning",
    "bf16",
    "bfloat16",
    "checkpoint",
    "comet",
    "comms_logger",
    "communication_data_type",
    "compile",
    "compression_training",
    "csv_monitor",
    "curriculum_learning",
    "data_efficiency",
    "data_parallel_size",
    "data_types",
    "dataloader_drop_last",
    "datastates_ckpt",
    "disable_allgather",
    "disable_python_gc",
    "dump_state",
    "eigenvalue",
    "elasticity",
    "expert_parallel",
    "flops_profiler",
    "fp16",
    "gradient_accumulation_steps",
    "gradient_allreduce_op",
    "gradient_clipping",
    "gradient_predivide_factor",
    "graph_harvesting",
    "hybrid_engine",
    "log_level",
    "managed_gradient_accumulation",
    "memory_breakdown",
    "nebula",
    "optimizer",
    "pipeline",
    "prescale_gradients",
    "progressive_layer_drop",
    "quantize_training",
    "scheduler",
    "seq_parallel_communication_data_type",
    "sequence_parallel_size",
    "sparse_attention",
    "sparse_gradients",
    "steps_per_print",
    "tensor_parallel",
    "tensorboard",
    "timers",
    "torch_autocast",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "use_data_before_expert_parallelism",
    "vocabulary_size",
    "wall_clock_breakdown",
    "wandb",
    "weight_quantization",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "zero_optimization",
)


# DeepSpeed keys the zero strategy derives from the spec -> the spec key to set instead.
DEEPSPEED_DERIVED_KEYS: dict[str, str] = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size (accumulation follows from it)",
    "train_batch_size": "train.global_batch_size",
    "optimizer": "optim.kind and the optim section",
    "scheduler": "optim.schedule and the optim section",
    "gradient_clipping": "optim.grad_clip",
    "bf16": "train.precision",
    "bfloat16": "train.precision",
    "fp16": "train.precision",
}


DEEPSPEED_DERIVED_ZERO_KEYS: tuple[str, ...] = (
    "stage",
    "offload_optimizer",
    "offload_param",
    "overlap_comm",
    "reduce_bucket_size",
)


TRACKING_BACKENDS: tuple[str, ...] = ("mlflow", "none")


CORRUPT_CHECKPOINT_ACTIONS: tuple[str, ...] = ("fail", "restart")


PROGRESS_MODES: tuple[str, ...] = ("auto", "bar", "lines", "jsonl", "quiet")


NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


NAME_MAX_CHARS = 100


MAX_BLOCK_SIZE = 131072
"""The longest row a spec may ask for (128k tokens): context parallelism makes rows of
tens of thousands of tokens trainable (`strategy.context_parallel`)."""


MAX_VOCAB_SIZE = 2**22
"""Above any real tokenizer's (262,144 is the largest in common use); ids past 65,535
are stored as uint32 token files."""


MAX_MARKOV_ORDER = 3


MAX_MARKOV_STATES = 2**20


MAX_SEED = 2**32 - 1


# Ceilings of every count in the spec: generous for any real run, and far below the
# values (1e30 steps, 1e5-wide layers) that would only fail later, in a worker.
MAX_STEPS = 10**9
"""Steps, and every cadence or distance counted in steps."""


MAX_BATCH_SIZE = 2**24
"""Samples in a global batch, a micro-batch, or micro-batches per pipeline step."""


MAX_WORKERS = 10_000
"""World size: workers, pipeline stages and replicas, parameter-server shards."""


MAX_UPDATES = MAX_STEPS * MAX_WORKERS
"""Parameter-server shard updates: every worker's every step."""


MAX_LAYERS = 10_000


MAX_WIDTH = 2**16
"""model.n_embd, model.n_head and compression.rank."""


MAX_NUMEL = 2**40
"""Elements counted in one bucket or tensor."""


MAX_BUCKET_MB = 2**20


MAX_EVAL_SAMPLES = 10**7


MAX_VIRTUAL_STAGES = 1000


MAX_CHECKPOINTS_KEPT = 10**6


MAX_RESTARTS = 10**6


MAX_CPUS_PER_WORKER = 1024


MAX_SLOW_FACTOR = 1000


MAX_START_TIMEOUT_S = 10**7


MAX_STEP_DELAY_S = 60


FILE_SOURCES: tuple[str, ...] = tuple(k.name for k in DATA_KIND_TABLE.values() if k.files)
"""Sources that read the user's files, named by `data.train` / `data.val`."""


RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")

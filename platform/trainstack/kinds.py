"""Every kind a job spec names, in one table each: `strategy.kind`, `model.kind` and
`data.kind`. The only place a kind is named.

Callers ask the kind's entry (`kind_of(cfg)`, `MODEL_KINDS[...]`, `DATA_KINDS[...]`)
what they need to know instead of comparing strings: where a strategy runs, which
engine trains it, whether it shards model state or lays ranks on a mesh, what it checks
of a built model, what builds it; which task a data source serves and whether it reads
files. Adding a strategy, a model family or a data source is its own module and one
entry here. Pure Python: the spec's checks (below the engines) read these tables too;
the code that builds each kind is named by import path and imported only where a job
uses it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from trainstack.config import JobConfig


@dataclass(frozen=True, kw_only=True)
class StrategyKind:
    name: str
    runs_on: Literal["ray_train", "actors", "plan"]
    """`ray_train`: a Ray Train worker group; `actors`: plain Ray actors (the parameter
    server's workers and shards); `plan`: replaced by the plan's layout before anything
    runs (`auto`)."""
    engine: Literal["torch", "deepspeed", "strategy.engine"]
    """Who trains it; `strategy.engine`: the spec's `strategy.engine` says."""
    float64: bool
    """Trains in `train.precision: fp64` (on its torch engine)."""
    shards_state: bool = False
    """Splits parameters, gradients or optimizer state across ranks."""
    ranks: Literal["replicas", "shards", "mesh", "pipeline"] = "replicas"
    """How its ranks fill the grid `[pp, dp_replicate, dp_shard, tp]` (`trainstack.dims`):
    each a replica; each a shard of one replica; a mesh of replica groups × shards ×
    `strategy.tensor_parallel`; or that mesh once per pipeline stage."""
    offload_param: Literal["no", "stage 3", "yes"] = "no"
    """Takes `strategy.offload_param` (parameters kept in host memory): never, with
    `strategy.stage: 3` only (ZeRO), or always (FSDP2's CPU offload)."""
    elastic: bool = False
    """Resizes its worker group (`scaling.num_workers: {min, max}`) at the same global batch."""
    plan_layout: str = ""
    """`module:callable(cfg) -> Layout`: the planner's layout for the spec's strategy
    (what pre-flight's memory check and `trainstack plan` compare); empty: none."""
    resumes_other_runs: bool = True
    """Starts from another run's checkpoint (`--resume-from`)."""
    dense_hooks: bool = False
    """Sends each replica's whole gradient through a DDP communication hook (where
    compression applies AdamW's moments on each rank, warms up, clips locally and
    adapts to the link)."""
    compresses: bool = False
    """Takes `compression:` (a DDP hook, or the parameter server's pushes)."""
    object_store_checkpoints: bool = True
    """Keeps its checkpoints in an object store as well as a shared filesystem."""
    build: str = ""
    """`module:callable(cfg, ctx) -> Strategy` run on each worker; empty for kinds that
    do not run as a worker group's strategy."""
    model_checks: tuple[str, ...] = ()
    """`module:callable(cfg, model)` pre-flight runs on the built model before Ray starts."""
    moe: Literal["yes", "no", "without bias"] = "yes"
    """Trains MoE layers (`model.moe`): yes; no (the aux loss and the expert dispatch do not
    cross its stages); or with every `balance` but `bias` (moved by the synchronous loop)."""
    expert_parallel: bool = False
    """Splits MoE layers' experts over `strategy.expert_parallel` ranks."""
    lora: bool = False
    """Trains low-rank adapters over frozen weights (`model.lora`)."""

    def engine_of(self, cfg: JobConfig) -> str:
        return cfg.strategy.engine if self.engine == "strategy.engine" else self.engine

    def builder(self) -> Callable[..., Any]:
        return load(self.build)

    def checks(self) -> list[Callable[..., None]]:
        return [load(path) for path in self.model_checks]


KINDS: dict[str, StrategyKind] = {
    k.name: k
    for k in (
        StrategyKind(
            name="ddp",
            runs_on="ray_train",
            engine="torch",
            float64=True,
            dense_hooks=True,
            compresses=True,
            elastic=True,
            expert_parallel=True,
            lora=True,
            plan_layout="trainstack.planner.layouts:ddp_layout",
            build="trainstack.strategies.ddp:DDPStrategy",
            model_checks=("trainstack.strategies.expert_parallel:check_expert_split",),
        ),
        StrategyKind(
            name="zero",
            runs_on="ray_train",
            engine="deepspeed",
            float64=False,
            shards_state=True,
            ranks="shards",
            offload_param="stage 3",
            elastic=True,
            lora=True,
            plan_layout="trainstack.planner.layouts:zero_layout",
            build="trainstack.strategies.zero:ZeROStrategy",
        ),
        StrategyKind(
            name="fsdp",
            runs_on="ray_train",
            engine="torch",
            float64=True,
            shards_state=True,
            ranks="mesh",
            offload_param="yes",
            lora=True,
            plan_layout="trainstack.planner.layouts:fsdp_layout",
            build="trainstack.strategies.fsdp:FSDPStrategy",
            model_checks=("trainstack.strategies.tensor_parallel:check_model_splits",),
        ),
        StrategyKind(
            name="pipeline",
            runs_on="ray_train",
            engine="strategy.engine",
            float64=True,
            ranks="pipeline",
            moe="no",
            lora=True,
            plan_layout="trainstack.planner.layouts:pipeline_layout",
            build="trainstack.strategies:build_pipeline",
            model_checks=("trainstack.strategies.pipeline_split:check_pipeline_model",),
        ),
        StrategyKind(
            name="ps",
            runs_on="actors",
            engine="torch",
            float64=False,
            resumes_other_runs=False,
            compresses=True,
            object_store_checkpoints=False,
            moe="without bias",
            model_checks=("trainstack.ps.partition:check_shards",),
        ),
        StrategyKind(name="auto", runs_on="plan", engine="torch", float64=False, lora=True),
    )
}
"""Every `strategy.kind`, by name."""


def kind_of(cfg: JobConfig) -> StrategyKind:
    return KINDS[cfg.strategy.kind]


def kinds_that(
    has: Callable[[Any], bool], *, table: Mapping[str, Any] | None = None, last: str = ", "
) -> str:
    """The names of the kinds with a property, for a message's `allowed:`: strategy kinds,
    or those of another `table` (`last` joins the last two: "ddp or ps")."""
    names = [k.name for k in (KINDS if table is None else table).values() if has(k)]
    return last.join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else "".join(names)


def load(path: str) -> Any:
    """What `module:attribute` names (the module imported on first use)."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True, kw_only=True)
class ModelKind:
    name: str
    build: str
    """`module:callable(cfg, *, vocab_size) -> nn.Module`."""
    builtin: bool = False
    """Its structure follows from the spec alone: parameters counted by formula
    (`count_parameters`), blocks known."""
    tensor_parallel: bool = False
    """Has a tensor-parallel plan (`strategy.tensor_parallel` > 1)."""
    shape_in_spec: bool = False
    """`model.n_layer`, `n_head` and `n_embd` are its shape (a transformer known before it
    is built: heads split whole by tensor parallelism, layers cut into pipeline stages,
    tensor-parallel stages inside a pipeline)."""
    hf_config: bool = False
    """Built from a Hugging Face config (`model.hf` or `model.pretrained`): its shape is
    read from that config, and `trainstack export` also writes a Hugging Face folder."""
    pipeline_layers: bool = True
    """Has pipeline layers to cut into stages (`strategy.kind: pipeline`)."""
    own_keys: tuple[str, ...] = ()
    """`model.*` keys that only this kind takes (where the model comes from)."""
    tasks: tuple[str, ...] = ("lm", "dpo")
    """The `task.kind`s it trains for (a language model: `lm` and `dpo`)."""
    spec_check: str = ""
    """`module:callable(model_section)` raising ConfigError for what this kind cannot take."""
    moe_in_spec: bool = False
    """Builds mixture-of-experts blocks from `model.moe`."""
    fused_loss: bool = False
    """Computes its LM loss from the targets without the logits (`model.fused_loss`)."""

    def builder(self) -> Any:
        return load(self.build)


MODEL_KINDS: dict[str, ModelKind] = {
    k.name: k
    for k in (
        ModelKind(
            name="gpt",
            build="trainstack.models.gpt:GPT",
            builtin=True,
            tensor_parallel=True,
            shape_in_spec=True,
            spec_check="trainstack.config.checks.model_data:check_gpt",
            moe_in_spec=True,
            fused_loss=True,
        ),
        ModelKind(
            name="mlp",
            build="trainstack.models.mlp:WindowMLP",
            builtin=True,
            pipeline_layers=False,
            tasks=("lm",),
        ),
        ModelKind(
            name="custom",
            build="trainstack.models.custom:build_custom_model",
            own_keys=("target", "args"),
            tasks=("lm", "classify", "dpo"),
            spec_check="trainstack.config.checks.model_data:check_custom_model",
        ),
        ModelKind(
            name="hf",
            build="trainstack.models.hf:build_hf_model",
            tensor_parallel=True,
            hf_config=True,
            own_keys=("hf", "pretrained"),
            spec_check="trainstack.config.checks.model_data:check_hf",
        ),
    )
}
"""Every `model.kind`, by name."""


@dataclass(frozen=True, kw_only=True)
class DataKind:
    name: str
    build: str
    """`module:Class` whose `from_config(data_section)` builds the corpus."""
    task: Literal["lm", "classify", "dpo", ""]
    """The task its samples are for (empty: either, as the user's own dataset says)."""
    files: bool = False
    """Reads the user's files (`data.train` / `data.val`, resolved against the spec)."""
    generated: bool = False
    """Synthesises its samples, held-out ones included (no files, no split to ask for)."""
    factory: str = ""
    """What `data.target` returns when it names a factory (then no files are read)."""
    factory_only: bool = False
    """Always built by `data.target`'s factory."""
    streams: bool = False
    """Rows stream through Ray Data, split per worker group by Ray Train (the driver
    builds the datasets): not indexed, so no elastic resize and no rows shared by
    tensor-parallel ranks."""
    chat_template: bool = False
    """Renders its records with `data.tokenizer`'s chat template (a Hugging Face tokenizer
    folder, or `data.chat_template`): the workers read those files too."""
    prepared: bool = False
    """Tokenized ahead of training into a cached directory (`trainstack prepare`, or
    pre-flight), from text whose bytes are known: the held-out loss is also given in bits
    per byte, beside gzip's and xz's."""
    spec_check: str = ""
    """`module:callable(data_section)` raising ConfigError for what this kind cannot take."""
    data_check: str = ""
    """`module:callable(cfg)`: pre-flight's look at the data itself (files readable, token
    ids below the vocabulary, the user's Dataset yielding what the task needs)."""

    def from_factory(self, target: str) -> bool:
        """Built by the user's `data.target` factory rather than from files."""
        return self.factory_only or bool(self.factory and target)

    def reads_files(self, target: str) -> bool:
        """Reads `data.train` / `data.val` (with `data.target` as the spec sets it)."""
        return self.files and not self.from_factory(target)


DATA_KINDS: dict[str, DataKind] = {
    k.name: k
    for k in (
        DataKind(
            name="markov",
            build="trainstack.data.markov:MarkovCorpus",
            task="lm",
            generated=True,
            spec_check="trainstack.config.checks.model_data:check_markov",
        ),
        DataKind(
            name="clusters",
            build="trainstack.data.clusters:ClustersCorpus",
            task="classify",
            generated=True,
            spec_check="trainstack.config.checks.model_data:check_clusters",
        ),
        DataKind(
            name="tokens",
            build="trainstack.data.tokens:TokenCorpus",
            task="lm",
            files=True,
            data_check="trainstack.data.checks:check_tokens",
        ),
        DataKind(
            name="text",
            build="trainstack.data.text:TextCorpus",
            task="lm",
            files=True,
            prepared=True,
            spec_check="trainstack.config.checks.model_data:check_text",
            data_check="trainstack.data.checks:check_text",
        ),
        DataKind(
            name="chat",
            build="trainstack.data.chat:ChatCorpus",
            task="lm",
            files=True,
            chat_template=True,
            data_check="trainstack.data.checks:check_chat",
        ),
        DataKind(
            name="preference",
            build="trainstack.data.preference:PreferenceCorpus",
            task="dpo",
            files=True,
            chat_template=True,
            data_check="trainstack.data.checks:check_preference",
        ),
        DataKind(
            name="arrays",
            build="trainstack.data.arrays:ArrayCorpus",
            task="classify",
            files=True,
            data_check="trainstack.data.checks:check_arrays",
        ),
        DataKind(
            name="ray",
            build="trainstack.data.ray_source:RaySource",
            task="lm",
            files=True,
            streams=True,
            factory="a ray.data.Dataset",
            data_check="trainstack.data.ray_source:check_ray_source",
        ),
        DataKind(
            name="custom",
            build="trainstack.data.custom_dataset:DatasetCorpus",
            task="",
            factory="a map-style torch Dataset",
            factory_only=True,
            data_check="trainstack.data.checks:check_custom",
        ),
    )
}
"""Every `data.kind`, by name (`ray`: pre-flight's view; workers stream through
`data.ray_stream`)."""


def model_kind_of(cfg: JobConfig) -> ModelKind:
    return MODEL_KINDS[cfg.model.kind]


def data_kind_of(cfg: JobConfig) -> DataKind:
    return DATA_KINDS[cfg.data.kind]

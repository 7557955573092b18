"""Sweep files: what a space expands to, and one clear ConfigError for each mistake."""

import dataclasses
import pickle
from pathlib import Path

import pytest
import yaml

from trainstack.cli import main
from trainstack.config import ConfigError
from trainstack.sweep import tuning
from trainstack.sweep.spec import load_sweep

REPO = Path(__file__).resolve().parents[2]
DEMO_SPEC = REPO / "jobs" / "configs" / "demo.yaml"


def write_sweep(tmp_path: Path, **sections: object) -> Path:
    raw = {"name": "s", "base": str(DEMO_SPEC), **sections}
    raw.setdefault("space", {"strategy.kind": ["ddp", "zero"]})
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def error_of(tmp_path: Path, **sections: object) -> str:
    with pytest.raises(ConfigError) as info:
        load_sweep(write_sweep(tmp_path, **sections))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_demo_sweep_grid_applies_conditions_without_duplicates() -> None:
    sweep = load_sweep(REPO / "tune" / "demo_sweep.yaml")
    grid = sweep.grid()
    assert grid == [
        {"strategy.kind": "ddp", "compression.kind": "none"},
        {"strategy.kind": "ddp", "compression.kind": "topk"},
        {"strategy.kind": "ddp", "compression.kind": "powersgd"},
        {"strategy.kind": "zero", "strategy.stage": 1},
        {"strategy.kind": "zero", "strategy.stage": 2},
        {"strategy.kind": "ps", "compression.kind": "none", "optim.grad_clip": 0.0},
        {"strategy.kind": "ps", "compression.kind": "topk", "optim.grad_clip": 0.0},
        {"strategy.kind": "ps", "compression.kind": "powersgd", "optim.grad_clip": 0.0},
    ]
    for overrides in grid:  # each is a valid job, with the sweep's fixed keys
        cfg = sweep.trial_config(overrides, name="t")
        assert cfg.train.steps == 300 and cfg.strategy.kind == overrides["strategy.kind"]


def test_distributions_are_drawn_within_bounds_and_checked_at_both_ends(tmp_path: Path) -> None:
    space = {
        "compression.kind": ["topk"],
        "compression.ratio": "loguniform(0.001, 0.1)",
        "train.seed": "randint(1, 3)",
    }
    sweep = load_sweep(write_sweep(tmp_path, space=space, search={"algorithm": "random"}))
    corners = list(sweep.corner_trials())
    assert [c["compression.ratio"] for c in corners] == [0.001, 0.1]
    assert [c["train.seed"] for c in corners] == [1, 3]
    domain = tuning.param_space(sweep)["sampled"]
    draws = [domain["compression.ratio"].sample() for _ in range(200)]
    assert min(draws) >= 0.001 and max(draws) <= 0.1
    seeds = {domain["train.seed"].sample() for _ in range(200)}
    assert seeds == {1, 2, 3}  # both ends included


def test_grid_search_space_holds_every_combination_once(tmp_path: Path) -> None:
    space = {"strategy.kind": ["ddp", "zero"], "train.micro_batch_size": [8, 16]}
    sweep = load_sweep(write_sweep(tmp_path, space=space, search={"algorithm": "grid"}))
    grid = tuning.param_space(sweep)["grid"]["grid_search"]
    assert len(grid) == 4 and len({tuple(sorted(g.items())) for g in grid}) == 4


def test_optuna_suggests_only_the_keys_whose_conditions_hold() -> None:
    sweep = load_sweep(REPO / "tune" / "demo_sweep.yaml")
    sweep = dataclasses.replace(
        sweep, search=dataclasses.replace(sweep.search, algorithm="optuna", num_samples=12)
    )
    searcher = tuning.searcher(sweep, concurrent=1)
    pickle.dumps(searcher)  # Tune pickles the searcher with the experiment state
    suggested = [searcher.suggest(f"t{i}")["sampled"] for i in range(12)]
    for values in suggested:
        kind = values["strategy.kind"]
        assert ("strategy.stage" in values) == (kind == "zero")
        assert ("compression.kind" in values) == (kind in ("ddp", "ps"))
        assert ("optim.grad_clip" in values) == (kind == "ps")
        sweep.trial_config(sweep.trial_overrides(values), name="t")  # valid specs


def test_concurrency_follows_the_cluster_and_the_largest_trial(tmp_path: Path) -> None:
    space = {"scaling.num_workers": [1, 2]}
    sweep = load_sweep(write_sweep(tmp_path, space=space))
    assert tuning.max_concurrent(sweep, {"CPU": 5.0}) == 2  # the 2-worker trial bounds it
    with pytest.raises(ConfigError, match="largest trial needs 2 CPU, the cluster has 1 CPU"):
        tuning.max_concurrent(sweep, {"CPU": 1.0})
    pinned = load_sweep(write_sweep(tmp_path, space=space, search={"max_concurrent_trials": 3}))
    assert tuning.max_concurrent(pinned, {"CPU": 1.0}) == 3


def test_asha_compares_at_a_fraction_of_the_largest_trials_tokens(tmp_path: Path) -> None:
    space = {"train.steps": [100, 200]}
    sweep = load_sweep(write_sweep(tmp_path, space=space, scheduler={"grace_fraction": 0.25}))
    asha = tuning.scheduler(sweep)
    tokens = 200 * 64 * 64  # demo: global batch 64, block 64
    assert asha._max_t == tokens and asha._brackets[0]._rungs[-1][0] == tokens // 4


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"spcae": {}}, "unknown key 'spcae'; did you mean 'space'?"),
        ({"space": {}}, "sweep space: expected a non-empty mapping"),
        ({"space": {"strategy.kidn": ["ddp"]}}, "unknown key 'strategy.kidn'; did you mean"),
        ({"space": {"train.steps": []}}, "sweep space.train.steps: the list of values is empty"),
        ({"space": {"optim.lr": "lognormal(1, 2)"}}, "unknown distribution 'lognormal'"),
        ({"space": {"optim.lr": "loguniform(0.1, 0.01)"}}, "needs finite bounds with low < high"),
        ({"space": {"optim.lr": "loguniform(0, 0.1)"}}, "a log distribution needs low > 0"),
        ({"space": {"train.seed": "randint(0, 2.5)"}}, "randint needs integer bounds"),
        ({"space": {"optim.lr": "uniform(a, 1)"}}, "bounds must be numbers"),
        ({"space": {"optim.lr": 0.1}}, "expected a list of values or a distribution"),
        ({"space": {"strategy": ["ddp"]}}, "'strategy' is a section; name one of its keys"),
        (
            {
                "space": {
                    "strategy.stage": {"values": [1], "when": {"strategy.kind": "zero"}},
                    "strategy.kind": ["zero"],
                }
            },
            "'strategy.kind' must be listed in the space before the key it decides",
        ),
        (
            {"space": {"strategy.kind": ["zero"], "compression.kind": ["topk"]}},
            "trial {'strategy.kind': 'zero', 'compression.kind': 'topk'} is not a valid job "
            "spec: compression.kind=topk needs strategy.kind=ddp or ps",
        ),
        ({"search": {"algorithm": "bayes"}}, "search.algorithm: unknown value 'bayes'"),
        ({"search": {"num_sampels": 2}}, "unknown key 'search.num_sampels'"),
        ({"objective": {"metric": "loss"}}, "objective.metric: unknown value 'loss'"),
        ({"objective": {"loss_bound": 2.5}}, "objective.loss_bound=2.5: allowed only with"),
        ({"scheduler": {"grace_fraction": 0}}, "scheduler.grace_fraction=0.0 is out of range"),
        ({"set": {"data.eval_samples": 0}}, "objective.metric=eval_loss needs held-out data"),
        ({"set": {"train.stesp": 3}}, "sweep set: unknown key 'train.stesp'"),
        ({"name": "bad name"}, "sweep name='bad name' is not a valid run name"),
    ],
)
def test_invalid_sweep_file_gets_one_line_naming_the_problem(
    tmp_path: Path, sections: dict, expected: str
) -> None:
    assert expected in error_of(tmp_path, **sections)


def test_missing_base_and_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("space: {strategy.kind: [ddp]}\n")
    with pytest.raises(ConfigError, match="'base' must name the job spec to start from"):
        load_sweep(path)
    with pytest.raises(ConfigError, match="cannot read sweep file"):
        load_sweep(tmp_path / "absent.yaml")


def test_cli_rejects_a_bad_sweep_file_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_sweep(tmp_path, space={"compression.ratio": "loguniform(1, 0.5)"})
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainstack: error: sweep space.compression.ratio: loguniform(1, 0.5)")
    assert "\n" not in err


def test_resume_of_a_sweep_that_never_ran_is_refused(tmp_path: Path) -> None:
    from trainstack.sweep.runner import run_sweep

    sweep = load_sweep(write_sweep(tmp_path, storage_path=str(tmp_path / "sweeps")))
    with pytest.raises(ConfigError, match="nothing to resume"):
        run_sweep(sweep, resume=True)


@pytest.mark.parametrize("path", sorted((REPO / "tune").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_sweep_files_load_and_track_in_mlflow(path: Path) -> None:
    sweep = load_sweep(path)
    assert sweep.base["tracking"]["backend"] == "mlflow" and len(sweep.grid()) >= 8


def test_a_sweep_that_already_ran_needs_resume(tmp_path: Path) -> None:
    from trainstack.sweep.runner import run_sweep

    sweep = load_sweep(write_sweep(tmp_path, storage_path=str(tmp_path / "sweeps")))
    sweep.sweep_dir.mkdir(parents=True)
    # What Tune leaves behind for Tuner.restore (as tests/e2e/test_sweep_cli.py does for real).
    (sweep.sweep_dir / "tuner.pkl").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"already ran at .*pass --resume"):
        run_sweep(sweep)


def test_set_override_with_bad_yaml_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"value is not valid YAML"):
        load_sweep(write_sweep(tmp_path), ["optim.betas=[0.9"])
    sweep = load_sweep(write_sweep(tmp_path), ["train.steps=120"])
    assert sweep.base["train"]["steps"] == 120 and sweep.fixed == {"train.steps": 120}


def test_trials_of_a_base_spec_with_an_object_store_keep_their_runs_locally(
    tmp_path: Path,
) -> None:
    from trainstack.config import config_from_dict
    from trainstack.sweep.runner import _trial_sweep

    base = yaml.safe_load(DEMO_SPEC.read_text())
    base["checkpoint"] = {
        "storage_path": "s3://my-bucket/runs",
        "storage_options": {"endpoint_override": "http://127.0.0.1:9", "scheme": "http"},
    }
    spec = tmp_path / "base.yaml"
    spec.write_text(yaml.safe_dump(base))
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": str(spec), "space": {"train.seed": [1]}}))
    sweep = load_sweep(path)
    cfg = config_from_dict(_trial_sweep(sweep).base)  # not refused: the options went too
    assert cfg.checkpoint.storage_path == str(sweep.sweep_dir / "runs")
    assert cfg.checkpoint.storage_options == {}

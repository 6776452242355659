"""A method lives in one place: what the harness knows of a method is declared on its strategy
and read from the registry, by every table, figure, sweep and contract test.

The last test is the proof: a toy method (signum, a majority vote of the workers' momentum
signs, through an all-reduce) written as exactly four files in a copy of this checkout, and
seen validated, planned in the quickstart and the laptop Table 1, in the comm table, in the
figures' palette, and under the resume and byte contracts, without another file touched.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from omegaconf import OmegaConf

from lowcomm.compress import CODECS
from lowcomm.config import ConfigError, config_dir, repo_root, validate_optimizer
from lowcomm.config.compose import compose
from lowcomm.config.sweep import load_sweep
from lowcomm.optim.args import Args
from lowcomm.report.comm_table import PEER_ROWS, paper_rows
from lowcomm.report.figures import FAMILY_COLORS, FAMILY_MARKERS
from lowcomm.report.runs import OPTIMIZER_NAMES
from lowcomm.strategies import METHOD_SWEEPS, STRATEGIES, StrategyConfig

NAMES = sorted(STRATEGIES)


@pytest.mark.parametrize("name", NAMES)
def test_every_yaml_field_is_a_config_field_and_every_config_field_is_in_the_yaml(name):
    """The yaml is the only place a default lives: the schema states none, so a field the yaml
    forgot is an error, not a silent Python default."""
    config = STRATEGIES[name].Config
    assert issubclass(config, StrategyConfig) and config.config_name == name
    yaml = OmegaConf.to_container(OmegaConf.load(config_dir() / "optimizer" / f"{name}.yaml"))
    assert yaml.pop("name") == name
    fields = {f.name: f for f in dataclasses.fields(config)}
    assert set(yaml) == set(fields)
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in fields.values())
    assert config(**yaml) == config.defaults()
    with pytest.raises(TypeError, match="missing"):
        config(**{key: value for key, value in yaml.items() if key != "lr"})


def test_no_algorithm_argument_states_a_default():
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    for args in subclasses(Args):
        for field in dataclasses.fields(args):
            assert field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING, (
                f"{args.__name__}.{field.name} has a default; defaults live in configs/optimizer/*.yaml")


@pytest.mark.parametrize("name", NAMES)
def test_a_config_error_names_the_optimizer_key(name):
    extra = ["compression=quantize"] if name == "muloco" else []
    with pytest.raises(ConfigError, match=r"optimizer\.lr must be > 0, got -1"):
        validate_optimizer(OmegaConf.to_container(compose([f"optimizer={name}", *extra, "optimizer.lr=-1"]),
                                                  resolve=True))


def test_every_method_has_its_own_name_marker_and_colour():
    assert set(OPTIMIZER_NAMES) == set(FAMILY_MARKERS) == set(FAMILY_COLORS) == set(STRATEGIES)
    assert len(set(FAMILY_COLORS.values())) == len(STRATEGIES)
    assert len(set(FAMILY_MARKERS.values())) == len(STRATEGIES)
    assert len(set(OPTIMIZER_NAMES.values())) == len(STRATEGIES)


@pytest.mark.parametrize("sweep", METHOD_SWEEPS)
def test_every_method_runs_in_the_quickstart_and_the_laptop_table1(sweep):
    jobs = load_sweep(sweep).jobs
    names = {override.split("=", 1)[1] for job in jobs for override in job if override.startswith("optimizer=")}
    assert names == set(STRATEGIES)
    labels = [override for job in jobs for override in job if override.startswith("label=")]
    assert len(labels) == len(set(labels)) == len(jobs)  # every run its own label


def test_every_method_is_in_the_comm_table():
    in_table = {overrides[0].split("=", 1)[1] for _, overrides, _ in PEER_ROWS}
    in_table |= {overrides[0].split("=", 1)[1] for _, overrides, _ in paper_rows("olmo_1b")}
    assert in_table == set(STRATEGIES)


@pytest.mark.parametrize(("marker", "color", "holder"), [
    ("o", "olive", "adamw_ddp"),   # AdamW-DDP's marker
    ("h", "C3", "demo"),           # DeMo's colour
    ("h", "C13", "demo"),          # the default cycle has ten colours: C13 is drawn as C3
    ("h", "NAVY", "eager_diloco"),  # colour names are case-insensitive
])
def test_register_refuses_a_marker_or_colour_already_taken(marker, color, holder):
    from lowcomm.strategies.base import Display, register

    adamw = STRATEGIES["adamw_ddp"]
    taken = type("Taken", (adamw,), {"name": "taken", "display": Display("Taken", marker=marker, color=color),
                                     "Config": type("TakenConfig", (adamw.Config,), {"config_name": "taken"})})
    with pytest.raises(TypeError, match=rf"is {holder}'s"):
        register(taken)
    assert "taken" not in STRATEGIES
    free = type("Free", (adamw,), {"name": "taken", "display": Display("Free", marker="h", color="olive"),
                                   "Config": taken.Config})
    try:
        assert register(free) is free
    finally:
        STRATEGIES.pop("taken", None)


def test_which_codecs_a_strategy_accepts_is_the_codecs_property():
    diloco, demo = STRATEGIES["diloco"], STRATEGIES["demo"]
    assert all(diloco.accepts_codec(codec) for codec in CODECS.values())
    assert not any(demo.accepts_codec(codec) for codec in CODECS.values())

    class MajorityVote:  # a codec whose decode is not the workers' mean
        name, decodes_mean = "vote", False

    assert not diloco.accepts_codec(MajorityVote)


# ------------------------------------------------------------------ a new method, four files
TOY_ALGORITHM = '''
    """Signum with a majority vote: each worker keeps the momentum of its own gradient, the
    workers average the signs of their momenta (an all-reduce) and step by the sign of that
    mean. A toy: the proof that a method is four files."""

    from __future__ import annotations

    from dataclasses import dataclass
    from typing import ClassVar

    import torch

    from lowcomm.comm import Communicator
    from lowcomm.optim.args import Args

    __all__ = ["SignVote", "SignVoteArgs"]


    @dataclass(kw_only=True)
    class SignVoteArgs(Args):
        config_name: ClassVar[str] = "signvote"

        lr: float
        beta: float

        def errors(self) -> list[str]:
            errors = super().errors()
            if not 0 <= self.beta < 1:
                errors.append(f"beta must be in [0, 1), got {self.beta}")
            return errors


    class SignVote(torch.optim.Optimizer):
        def __init__(self, params, args: SignVoteArgs, comm: Communicator | None = None):
            self.args = args.check()
            super().__init__(params, {"lr": args.lr, "beta": args.beta})
            self.comm = comm if comm is not None else Communicator()

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    momentum = self.state[p].setdefault("momentum", torch.zeros_like(p))
                    momentum.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                    vote = torch.sign(momentum)
                    self.comm.all_reduce(vote, op="avg")
                    p.add_(torch.sign(vote), alpha=-group["lr"])
'''

TOY_STRATEGY = '''
    """Sign vote as a strategy."""

    from __future__ import annotations

    from dataclasses import dataclass
    from typing import ClassVar

    import torch

    from lowcomm.optim.signvote import SignVote, SignVoteArgs
    from lowcomm.strategies.base import (
        Display,
        Point,
        Row,
        Strategy,
        StrategyConfig,
        parameter_bytes,
        register,
        trainable_parameters,
    )


    @dataclass(kw_only=True)
    class SignVoteConfig(StrategyConfig, SignVoteArgs):
        config_name: ClassVar[str] = "signvote"


    @register
    class SignVoteStrategy(Strategy):
        name = "signvote"
        Config = SignVoteConfig
        display = Display("Sign vote", marker="h", color="olive")
        quickstart = (Point("Sign vote", "optimizer.lr=1e-3"),)
        table1_tiny = quickstart
        comm_table = (Row("Sign vote (toy)"),)
        replicated_optimizer_state = False  # each worker's own momentum

        def build(self, model: torch.nn.Module):
            return model, SignVote(trainable_parameters(model), self.cfg, self.comm)

        def optimizer_state_bytes(self, model, local_world_size):
            return 0.0, parameter_bytes(model)

        def analytic_payload_bytes(self, model: torch.nn.Module) -> float:
            return parameter_bytes(model)
'''

TOY_CONFIG = '''
    # Sign vote (a toy): signum whose momentum signs are averaged over the workers.
    name: signvote
    lr: 1.0e-3
    beta: 0.9
    clip_global_norm: true
    decay_embeddings: false
'''

TOY_TEST = '''
    import pytest
    import torch

    from lowcomm.optim.signvote import SignVote, SignVoteArgs


    def test_one_worker_steps_by_the_sign_of_its_momentum():
        param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
        optimizer = SignVote([param], SignVoteArgs.defaults(lr=0.5))
        param.grad = torch.tensor([0.25, -4.0, 0.0])
        optimizer.step()
        # m = 0.1 g = [0.025, -0.4, 0]; sign: [1, -1, 0]; p - 0.5 sign
        assert param.tolist() == [0.5, -1.5, 3.0]
        with pytest.raises(ValueError, match="beta must be in"):
            SignVote([param], SignVoteArgs.defaults(beta=1.0))
'''

TOY_CHECKS = '''
    import lowcomm
    from lowcomm.config import ConfigError, validate
    from lowcomm.config.compose import compose
    from lowcomm.config.sweep import load_sweep, plan_sweep
    from lowcomm.report.figures import FAMILY_COLORS, FAMILY_MARKERS
    from lowcomm.report.runs import OPTIMIZER_NAMES

    print("package", lowcomm.__file__)
    run = validate(compose(["optimizer=signvote"]))
    print("validated", run.run_name, run.optimizer)
    try:
        validate(compose(["optimizer=signvote", "optimizer.beta=2"]))
    except ConfigError as exc:
        print("refused", exc.errors)
    for sweep in ("quickstart", "table1_tiny"):
        labels = [planned.run.label for planned in plan_sweep(load_sweep(sweep))]
        print("planned", sweep, "Sign vote" in labels)
    print("figures", OPTIMIZER_NAMES["signvote"], FAMILY_MARKERS["signvote"], FAMILY_COLORS["signvote"])
'''

COPIED = ("src", "configs", "sweeps", "tests", "results/paper", "pyproject.toml")


@pytest.mark.slow
def test_a_new_method_is_four_files(tmp_path):
    checkout = tmp_path / "lowcomm"
    for part in COPIED:
        source = repo_root() / part
        if source.is_dir():
            shutil.copytree(source, checkout / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(source, checkout / part)
    four_files = {
        "src/lowcomm/optim/signvote.py": TOY_ALGORITHM,
        "src/lowcomm/strategies/signvote.py": TOY_STRATEGY,
        "configs/optimizer/signvote.yaml": TOY_CONFIG,
        "tests/test_signvote.py": TOY_TEST,
    }
    for path, text in four_files.items():
        (checkout / path).write_text(textwrap.dedent(text).lstrip())
    env = {**os.environ, "PYTHONPATH": str(checkout / "src"), "LOWCOMM_CONFIG_DIR": str(checkout / "configs")}

    def run(*command: str) -> str:
        done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{command}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        return done.stdout

    checks = run(sys.executable, "-c", textwrap.dedent(TOY_CHECKS))
    assert f"package {checkout / 'src' / 'lowcomm' / '__init__.py'}" in checks  # the copy, not this checkout
    assert "validated tiny-signvote-w4-" in checks
    assert "refused ['optimizer.beta must be in [0, 1), got 2.0']" in checks
    assert "planned quickstart True" in checks and "planned table1_tiny True" in checks
    assert "figures Sign vote h olive" in checks

    table = run(sys.executable, "-m", "lowcomm.cli.comm_table", "--model", "olmo_300m")
    row = next(line for line in table.splitlines() if "Sign vote (toy)" in line)
    assert "1279.787" in row  # every fp32 parameter of OLMo-300M once: 319,946,752 x 4 bytes

    # the contracts every method is held to, on the copy: resume mid-run bit for bit, metered
    # bytes against the comm table, the registry's checks, and the method's own test
    # -rA: a line for each test that passed, so the method's own cases are seen to have run
    tests = run(sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                "tests/test_signvote.py", "tests/test_resume.py", "tests/test_comm_table.py",
                "tests/test_registry.py", "-k", "signvote or Sign or every_method or every_yaml or no_algorithm")
    for test in ("tests/test_resume.py::test_a_run_stopped_mid_period_resumes_bit_for_bit['Sign vote']",
                 "tests/test_comm_table.py::test_every_strategy_meters_what_the_table_predicts_and_balances[signvote]"):
        assert f"PASSED {test}" in tests, tests[-3000:]
    summary = tests.strip().splitlines()[-1]
    assert "failed" not in summary and "error" not in summary, tests[-3000:]
    assert int(summary.split(" passed")[0].split()[-1]) >= 7, summary  # its own, resume, bytes, 4+ registry
    for path in four_files:
        assert (checkout / path).is_file()

"""The public surface and the house rules: public names, registered strategies, subcommands and shipped
configs do not move; imports run one way (a reversed import breaks the contract); the manual's layout
(docs/contributing.md) names every module once."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_shardlab
from lightning_shardlab import cli

pytestmark = pytest.mark.quick  # the smoke tier (bash scripts/test.sh --quick)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_shardlab"
PUBLIC = (
    "ShardLabStrategy", "ShardLabBudget", "ShardLabSanity", "ShardLabVitals", "ShardLabPrecision", "ShardLabEMA",
    "SanityConfig", "SanityGuard", "ShardLabConfig", "Stage", "Accumulation", "Comm", "CheckpointError",
    "ShardedModel", "shard_model", "shard_optimizer",
)  # fmt: skip
STRATEGIES = ("shardlab", "shardlab_stage_1", "shardlab_stage_2", "shardlab_stage_3")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
LAYOUT = ROOT / "docs" / "contributing.md"  # the manual's page for contributors holds the layout list
OPTIONS_PAGE = ROOT / "docs" / "options.md"  # the manual's table of every option


def test_public_names_strategies_and_subcommands_stay_where_users_find_them() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert set(PUBLIC) <= set(lightning_shardlab.__all__)
    for name in PUBLIC:
        assert getattr(lightning_shardlab, name) is not None
    for name in STRATEGIES:
        assert StrategyRegistry[name]["strategy"] is lightning_shardlab.ShardLabStrategy
    text = cli.usage()
    for command in ("fit", "validate", "test", "predict", "plan", "consolidate", "export", "inspect"):
        assert f"  {command} " in text
    for module, _ in cli.TOOLS.values():
        assert callable(importlib.import_module(module).main)


def _class_paths(text: str) -> set[str]:
    return set(re.findall(r"class_path:\s*([\w.]+)", text))


def test_every_class_path_in_the_configs_readme_and_manual_imports() -> None:
    paths = set()
    for source in [
        *sorted((ROOT / "configs").glob("*.yaml")),
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
    ]:
        paths |= _class_paths(source.read_text())
    assert "lightning_shardlab.ShardLabBudget" in paths and "lightning_shardlab.examples.gpt.GPT" in paths
    for path in sorted(paths):
        module, _, name = path.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), name), type), path


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_shipped_config_parses(
    config: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["shardlab"])  # as if typed: shardlab fit --config ... --print_config
    with pytest.raises(SystemExit) as done:
        cli.main(["fit", "--config", str(ROOT / "configs" / config), "--print_config"])
    assert done.value.code in (None, 0)
    assert "strategy" in capsys.readouterr().out


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root, env={"PYTHONPATH": str(root), "PATH": str(LINT_IMPORTS.parent)}, capture_output=True, text=True,
    )  # fmt: skip


def test_imports_run_one_way_and_a_reversed_import_breaks_the_contract(tmp_path: Path) -> None:
    kept = _lint_imports(ROOT)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    shutil.copytree(PACKAGE, tmp_path / "lightning_shardlab", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    ledger = tmp_path / "lightning_shardlab" / "comm" / "ledger.py"
    ledger.write_text(ledger.read_text() + "\nfrom lightning_shardlab.sharding import unit  # noqa: E402,F401\n")
    broken = _lint_imports(tmp_path)
    assert broken.returncode != 0
    assert "BROKEN" in broken.stdout and "lightning_shardlab.comm.ledger -> lightning_shardlab.sharding.unit" in (
        broken.stdout
    ), broken.stdout


def _subpackages() -> list[Path]:
    """Every package folder under the package, nested ones too (budget/measured/)."""
    return sorted(
        p.parent for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE and "__pycache__" not in p.parts
    )


def test_manual_layout_names_every_module_once() -> None:
    page = LAYOUT.read_text()
    section = page.split("## Layout", 1)[1].split("\n#", 1)[0]
    bullets = [line for line in re.split(r"\n- ", section) if line.strip()]
    for folder in _subpackages():
        where = folder.relative_to(PACKAGE).as_posix()
        modules = sorted(p.name for p in folder.glob("*.py") if p.name != "__init__.py")
        bullet = next((b for b in bullets if b.lstrip("- ").startswith(f"`{where}/`")), None)
        assert bullet is not None, f"the layout in {LAYOUT.relative_to(ROOT)} does not name {where}/"
        named = re.findall(r"`(\w+\.py)`", bullet)
        assert sorted(named) == modules, f"{where}/: {LAYOUT.name} names {sorted(named)}, the folder has {modules}"
    top = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    outside = " ".join(b for b in bullets if not re.match(r"-? ?`[\w/]+/`", b))
    for name in top:
        assert re.findall(rf"`{re.escape(name)}`", outside) == [f"`{name}`"], name


def test_every_subpackage_names_its_files_in_its_docstring() -> None:
    """Each folder's ``__init__`` describes its files: every module there is named, and no file it names is
    missing (a name with a folder, ``checkpoint/format.py``, points elsewhere and is not counted)."""
    for folder in _subpackages():
        dotted = folder.relative_to(PACKAGE).as_posix().replace("/", ".")
        doc = importlib.import_module(f"lightning_shardlab.{dotted}").__doc__ or ""
        named = set(re.findall(r"(?<![\w/.])(\w+\.py)\b", doc))
        modules = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
        assert modules <= named, f"{folder.name}/__init__.py does not name {sorted(modules - named)}"
        assert named <= modules, f"{folder.name}/__init__.py names {sorted(named - modules)}, not in {folder.name}/"


def test_every_option_is_written_once_and_seen_everywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both strategies show every option (the config fields) in their signature and docs, typed as they accept
    them, and a YAML config's strategy options (classes by import path, an enum by value) reach the config."""
    from lightning_shardlab import fabric
    from lightning_shardlab.common.options import OPTIONS, field_docs
    from lightning_shardlab.core.config import ShardLabConfig

    for strategy in (lightning_shardlab.ShardLabStrategy, fabric.ShardLabStrategy):
        params = inspect.signature(strategy).parameters
        assert [p for p in params if p in OPTIONS] == list(OPTIONS), strategy
        assert params["stage"].default == 3 and params["accumulation"].default == "reduce"
        for name in OPTIONS:
            assert re.search(rf"^\s+{name}: \S", strategy.__doc__, re.M), (strategy, name)
    assert set(field_docs(ShardLabConfig)) == {f.name for f in dataclasses.fields(ShardLabConfig)}  # each documented
    table = OPTIONS_PAGE.read_text()
    assert [name for name in OPTIONS if f"| `{name}` |" not in table] == []  # the manual's table lists each
    config = tmp_path / "strategy.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_shardlab.ShardLabStrategy\n    init_args:\n"
        "      stage: 2\n      accumulation: defer\n      gradient_clip_norm_type: inf\n"
        "      unit_classes: [lightning_shardlab.examples.gpt.Block, torch.nn.Linear]\n"
        "model:\n  class_path: lightning_shardlab.examples.gpt.GPT\n"
    )
    monkeypatch.setattr(sys, "argv", ["shardlab"])
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", str(config), "--print_config"])
    printed = capsys.readouterr().out
    assert "- lightning_shardlab.examples.gpt.Block" in printed and "accumulation: defer" in printed, printed
    assert "gradient_clip_norm_type: inf" in printed and "stage: 2" in printed

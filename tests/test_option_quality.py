"""The fine-tune's fewer-bytes flags and the option-quality benchmark's arithmetic, in this process (no ranks).

The flags must reach the fine-tune's strategy as its options (and nothing when none is given: the README's run
stays exact), every variant benchmarks/option_quality.py launches must parse to the options it names, and the
benchmark's table and reading must say what the numbers say, checked here on numbers given by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import option_quality
from lightning_shardlab.examples.finetune import fewer_bytes, loss_rows, make_strategy, parse_args


def strategy_options(argv: list[str]) -> tuple[str | None, str | None, int]:
    config = make_strategy(3, **fewer_bytes(parse_args(argv))).config
    return config.reduce_dtype, config.gather_dtype, config.quant_block_size


def test_flags_reach_the_finetune_strategy_and_the_defaults_stay_exact() -> None:
    assert fewer_bytes(parse_args([])) == {} and fewer_bytes(parse_args(["--quick", "--runs", "x"])) == {}
    assert strategy_options([]) == (None, None, 2048)
    assert strategy_options(["--reduce-dtype", "bf16"]) == ("bf16", None, 2048)
    assert strategy_options(["--reduce-dtype", "fp16"]) == ("fp16", None, 2048)
    flags = ["--reduce-dtype", "int8", "--gather-dtype", "int8", "--quant-block-size", "512"]
    assert strategy_options(flags) == ("int8", "int8", 512)
    assert make_strategy(3, **fewer_bytes(parse_args(flags))).config.stage == 3
    for bad in (["--reduce-dtype", "fp8"], ["--quant-block-size", "64"], ["--finetune-steps", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_every_benchmarked_option_parses_to_its_own_options(tmp_path: Path) -> None:
    seen = set()
    for name, flags in option_quality.OPTIONS.items():
        command = option_quality.finetune_command(tmp_path, name, quick=True, steps=7)
        assert command[1:3] == ["-m", "lightning_shardlab.examples.finetune"]
        assert command[len(command) - len(flags) :] == flags
        args = parse_args(command[3:])
        assert (args.quick, args.finetune_steps, Path(args.runs)) == (True, 7, tmp_path)
        assert Path(args.finetune_dir) == tmp_path / "quick" / name  # one folder each, one pretrained checkpoint
        seen.add(strategy_options(command[3:]))
    assert seen == {
        (None, None, 2048), ("bf16", None, 2048), ("fp16", None, 2048), ("int8", None, 2048),
        (None, "int8", 2048), ("int8", "int8", 2048),
    }  # fmt: skip


def result(before: float, after: float, saved: float, megabytes: float) -> dict:
    return {
        "perplexity_before": before, "perplexity_after": after, "saved_perplexity": saved,
        "bytes_per_step": megabytes * 1e6,
    }  # fmt: skip


def test_table_and_reading_on_numbers_given_by_hand() -> None:
    results = {
        "exact": result(40.0, 20.0, 19.9, 4.0),
        "reduce_bf16": result(40.0, 20.1, 20.0, 3.0),  # +0.5 %: within
        "reduce_int8": result(40.0, 20.4, 20.298, 1.0),  # +2 %: missed
    }
    header, rule, *rows = option_quality.table(results)
    assert header.startswith("| option | flags |") and rule.count("---") == 8
    assert rows == [
        "| exact | `(defaults)` | 40.000 | 20.000 | 1.0000 | yes | 19.900 (1.0000) | 4.00 MB (1.00) |",
        "| reduce_bf16 | `--reduce-dtype bf16` | 40.000 | 20.100 | 1.0050 | yes | 20.000 (1.0050) | 3.00 MB (0.75) |",
        "| reduce_int8 | `--reduce-dtype int8` | 40.000 | 20.400 | 1.0200 | **no** (+2.00 %) | 20.298 (1.0200) "
        "| 1.00 MB (0.25) |",
    ]
    assert option_quality.reading(results) == ["Missed the 1 % goal: reduce_int8 (+2.00 %)."]
    del results["reduce_int8"]
    assert option_quality.reading(results) == [
        "Every option ends within 1 % of the exact run; the farthest is reduce_bf16 (+0.500 %)."
    ]


def test_loss_rows_read_each_logged_point(tmp_path: Path) -> None:
    csv = tmp_path / "metrics.csv"
    csv.write_text("epoch,step,train_loss,val_loss,val_ppl\n0,4,2.5,,\n0,9,2.25,,\n0,9,,2.0,7.39\n")
    assert loss_rows(csv) == {"train_loss": [(4, 2.5), (9, 2.25)], "val_loss": [(9, 2.0)]}

"""The sweep report from fake trial histories: statuses, derived columns, time to target, the
"every trial" section, repeats' spread, the CPU label. No Ray."""

from __future__ import annotations

import csv
import io

import pytest

from raypack.tune.report import (
    COLUMNS, Context, format_csv, format_table, label, result_row, spread, target_loss, time_to_target, with_targets,
)


def history(losses, evals=None, total=8, per_step_tokens=500.0, step_s=0.5, every=2, per_epoch=8):
    """Reports every `every` steps, like a Train run's; evals[i] is the eval loss of report i (or None)."""
    out = []
    for i, loss in enumerate(losses):
        step = (i + 1) * every
        out.append({
            "step": step, "total_steps": total, "steps_per_epoch": per_epoch, "loss": loss,
            "eval_loss": (evals or [None] * len(losses))[i], "tokens_seen": step * per_step_tokens,
            "train_time_s": step * step_s, "eval_time_s": 0.1 * i, "tokens_per_s": per_step_tokens / step_s,
            "packing_efficiency": 0.97, "peak_memory_gb": 0.5, "mfu": None,
        })
    return out


OK = result_row({"strategy": "bfd", "budget": 256, "lr": 3e-3},
                history([5.0, 4.6, 4.3, 4.1], [None, 4.7, None, 4.2]), None, "TERMINATED", "t_00000")
SLOW = result_row({"strategy": "pad", "budget": 256, "lr": 3e-3, "batch_size": 2.4},
                  history([5.0, 4.8, 4.6, 4.5], [None, 4.9, None, 4.55], step_s=1.0), None, "TERMINATED", "t_00001")
STOPPED = result_row({"strategy": "bfd", "budget": 256, "lr": 1e-6}, history([5.5, 5.5]), None, "TERMINATED", "t_00002")
FAILED = result_row({"strategy": "balanced", "budget": 512, "lr": 1e-3}, [],
                    RuntimeError("ray::ImplicitFunc.train() (pid=1)\n  File ...\nRuntimeError: worker died"), "ERROR", "t_00003")
CUT = result_row({"strategy": "balanced", "budget": 256, "lr": 3e-3}, history([5.0]), None, "RUNNING", "t_00004")
ROWS = [OK, SLOW, STOPPED, FAILED, CUT]


def test_status_of_every_kind():
    assert [r["status"] for r in ROWS] == ["OK", "OK", "STOPPED", "ERROR", "UNFINISHED"]
    assert FAILED["error"] == "RuntimeError: worker died" and FAILED["tokens_per_s"] is None
    # A trial that reached its last step is OK even if the scheduler's last word was "stop".
    assert result_row({"strategy": "pad", "budget": 8, "lr": 1.0}, history([1.0] * 4), None, "TERMINATED")["status"] == "OK"


def test_derived_columns_come_from_the_whole_run():
    assert OK["steps"] == 8 and OK["total_steps"] == 8
    assert OK["tokens_per_s"] == pytest.approx(8 * 500 / 4.0)      # tokens_seen / train_time_s
    assert OK["tokens_per_step"] == pytest.approx(500)
    assert OK["epoch_time_s"] == pytest.approx(4.0)                 # 8 steps = one epoch
    assert STOPPED["epoch_time_s"] == pytest.approx(2.0 / (4 / 8))  # extrapolated from half an epoch
    assert OK["eval_loss"] == 4.2 and OK["loss"] == 4.1            # the last eval, the last window


def test_target_is_the_worst_final_eval_of_finished_trials():
    assert target_loss(ROWS, None) == 4.55     # pad's; the stopped and failed trials don't count
    assert target_loss(ROWS, 4.0) == 4.0
    assert time_to_target(OK["history"], 4.55) == pytest.approx(4.0)   # bfd's first eval (4.7) misses, its last makes it
    assert time_to_target(SLOW["history"], 4.55) == pytest.approx(8.0)
    assert time_to_target(OK["history"], 4.0) is None
    rows, target = with_targets(ROWS, None)
    assert target == 4.55 and rows[0]["time_to_target_s"] == pytest.approx(4.0)


def test_table_states_what_it_measured():
    table = format_table(ROWS, Context(title="T", on_cpu=True, notes=["Equal work per optimizer step: the rule"]))
    lines = table.splitlines()
    header = lines.index("| " + " | ".join(COLUMNS) + " |")
    body = [l for l in lines[header + 2:] if l.startswith("| ")][:5]
    assert len(body) == 5
    assert body[0].startswith("| bfd | 256 | 0.003 | t_00000 | OK | 8 | 500 | 1000 | 4 | 4 | 4.1 | 4.2 |")
    assert "not representative of GPU throughput" in table
    assert "- Equal work per optimizer step: the rule" in table
    assert "at or below 4.55 (the worst final eval loss" in table
    assert "- bfd-b256-lr1e-06 (t_00002): stopped early by the scheduler at step 4 of 8" in table
    assert "- balanced-b512-lr0.001 (t_00003): failed at step - of -: RuntimeError: worker died" in table
    assert "`raypack sweep --resume` runs it" in table
    assert "Repeats" not in table  # no grid point ran twice
    assert "had not started" not in table
    assert "- 2 more trial(s) had not started" in format_table(ROWS, Context(not_started=2))
    # and on a GPU sweep no CPU label
    assert "not representative" not in format_table(ROWS, Context(on_cpu=False))


def test_repeats_show_median_and_range():
    repeats = [result_row({"strategy": "bfd", "budget": 256, "lr": 3e-3},
                          history([5.0, 4.6, 4.3, 4.1], [None, None, None, 4.2], step_s=s), None, "TERMINATED", f"r{i}")
               for i, s in enumerate([0.5, 0.6, 0.9])]
    (group,) = spread(repeats + [STOPPED])
    assert group["n"] == 3
    med, lo, hi = group["tokens_per_s"]
    assert (med, lo, hi) == pytest.approx((500 / 0.6, 500 / 0.9, 500 / 0.5))
    assert "## Repeats: median [min, max]" in format_table(repeats)
    assert "| bfd | 256 | 0.003 | 3 | 833.3 [555.6, 1000] |" in format_table(repeats)


def test_csv_has_every_trial_and_its_error():
    rows = list(csv.DictReader(io.StringIO(format_csv(ROWS))))
    assert [r["strategy"] for r in rows] == ["bfd", "pad", "bfd", "balanced", "balanced"]
    assert rows[1]["batch_size"] == "2.4" and rows[1]["time_to_target_s"] == "8.0"
    assert rows[3]["status"] == "ERROR" and rows[3]["loss"] == "" and "worker died" in rows[3]["error"]


def test_a_lora_rank_sweep_shows_the_rank_column():
    """Only a sweep with adapters gets the lora_r column, after lr, in the table, the CSV and the labels."""
    rows = [{**r, "lora_r": rank} for r, rank in zip(ROWS, (4, 16, 4, 16, 4))]
    table = format_table(rows, Context(title="T"))
    i = COLUMNS.index("lr") + 1
    assert "| " + " | ".join([*COLUMNS[:i], "lora_r", *COLUMNS[i:]]) + " |" in table.splitlines()
    assert format_csv(rows).splitlines()[0].startswith("strategy,budget,lr,lora_r,trial")
    assert label(rows[0]).startswith("bfd-b256-lr0.003-r4")
    assert "lora_r" not in format_table(ROWS, Context(title="T")) and "lora_r" not in format_csv(ROWS)


def test_a_dpo_beta_sweep_shows_beta_and_the_eval_reward_accuracy():
    """A DPO sweep's rows carry beta (after lr) and the held-out pairs' reward accuracy (after eval_loss)."""
    rows = [{**r, "beta": beta, "eval_rewards/accuracies": 0.75} for r, beta in zip(ROWS, (0.05, 0.1, 0.5, 0.05, 0.1))]
    header = next(line for line in format_table(rows, Context(title="T")).splitlines() if line.startswith("| strategy"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert cells[cells.index("lr") + 1] == "beta"
    assert cells[cells.index("eval_loss") + 1] == "eval_rewards/accuracies"
    assert label(rows[0]).startswith("bfd-b256-lr0.003-beta0.05")
    assert "beta" not in format_table(ROWS, Context(title="T"))


def test_a_router_coefficient_sweep_shows_its_column_and_label():
    """A swept router loss coefficient is a column after lr (after the rank and beta when those are
    swept too), part of the label, and of what makes trials repeats of one another."""
    rows = [{**r, "router_aux_loss_coef": c} for r, c in zip(ROWS, (0.0, 0.01, 0.0, 0.001, 0.0))]
    i = COLUMNS.index("lr") + 1
    table = format_table(rows, Context(title="T"))
    assert "| " + " | ".join([*COLUMNS[:i], "router_aux_loss_coef", *COLUMNS[i:]]) + " |" in table.splitlines()
    assert format_csv(rows).splitlines()[0].startswith("strategy,budget,lr,router_aux_loss_coef,trial")
    assert label(rows[0]) == "bfd-b256-lr0.003-aux0 (t_00000)" and label(rows[1]).startswith("pad-b256-lr0.003-aux0.01")
    both = [{**r, "lora_r": 4} for r in rows]
    assert format_csv(both).splitlines()[0].startswith("strategy,budget,lr,lora_r,router_aux_loss_coef,trial")
    assert label(both[1]).startswith("pad-b256-lr0.003-r4-aux0.01")
    assert "router_aux_loss_coef" not in format_table(ROWS, Context(title="T"))
    # repeats group by the coefficient too: two at 0 make one group, the one at 0.01 none
    repeats = [result_row({"strategy": "bfd", "budget": 256, "lr": 3e-3, "router_aux_loss_coef": c},
                          history([5.0, 4.1], [None, 4.2], total=4), None, "TERMINATED", f"r{i}")
               for i, c in enumerate((0.0, 0.0, 0.01))]
    (group,) = spread(repeats)
    assert (group["router_aux_loss_coef"], group["n"]) == (0.0, 2)
    assert "| bfd | 256 | 0.003 | 0 | 2 |" in format_table(repeats)

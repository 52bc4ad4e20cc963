"""The verdict table and the method-choice table: each claim's paired difference, its interval and
the verdict they allow, computed from a results folder's metrics.csv (tools.claims, the checkout's record tooling)."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest

from fedcond.errors import FedcondError
from tools.claims import (
    README_BEGIN,
    README_END,
    choice_table,
    claims_table,
    load_claims,
    measure,
    pending_lines,
    post_hoc_lines,
    ranked_methods,
    readme_block,
    verdict,
    verdicts_markdown,
    with_readme_block,
)


def results_folder(path: Path, finals: dict[tuple[str, int], float], settings: dict | None = None,
                   methods: list | None = None, extra: dict[str, str] | None = None) -> Path:  # fmt: skip
    """A results folder whose runs (method label, seed) end at the given accuracies, after a first
    round at 0.1 that no verdict may read."""
    path.mkdir(parents=True)
    labels = methods or sorted({method for method, _ in finals})
    seeds = sorted({seed for _, seed in finals})
    experiment = {"kind": "sweep", "title": path.name, "settings": settings or {"dataset": "digits"},
                  "axes": {"method": labels, "seed": seeds}, "tables": []}  # fmt: skip
    (path / "experiment.json").write_text(json.dumps(experiment))
    with (path / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["method", "seed", "round", "accuracy", *(extra or {})])
        writer.writeheader()
        for (method, seed), accuracy in finals.items():
            if math.isnan(accuracy):  # not run
                continue
            label = method if isinstance(method, str) else method["label"]
            writer.writerow({"method": label, "seed": seed, "round": 1, "accuracy": 0.1, **(extra or {})})
            writer.writerow({"method": label, "seed": seed, "round": 2, "accuracy": accuracy, **(extra or {})})
    return path


def claims_file(path: Path, body: str) -> Path:
    (path / "claims.toml").write_text(body)
    return path / "claims.toml"


MATCHES = """
# A claims file with one claim, its runs in results/e1 beside it.
[[claim]]
experiment = "E1"
claim = "Conditional matches Oracle"
kind = "matches"
margin = 0.5
seeds = 3
section = "notes.md#e1"
[claim.federated]
folder = "results/e1"
setting = "digits"
subject = "conditional"
reference = "oracle"
"""


def test_a_verdict_follows_the_paired_interval_and_the_claims_kind():
    # +0.2 +- 0.25 lies above -0.5: matches holds; it contains 0: beats is not established.
    assert verdict("matches", 0.5, [0.1, 0.2, 0.3]) == "holds"
    assert verdict("beats", 0.0, [0.1, 0.2, 0.3]) == "not established at 3 seeds"
    assert verdict("beats", 0.0, [-0.1, 0.2, 0.5]) == "not established at 3 seeds"
    assert verdict("beats", 0.0, [1.0, 1.2, 1.4]) == "holds"
    assert verdict("beats", 0.0, [-1.0, -1.2, -1.4]) == "does not hold"
    # -2 +- 0.25 lies wholly under -0.5; -0.5 +- 0.25 straddles it.
    assert verdict("matches", 0.5, [-1.9, -2.0, -2.1]) == "does not hold"
    assert verdict("matches", 0.5, [-0.4, -0.5, -0.6]) == "not established at 3 seeds"
    # One seed has no interval, however large its difference.
    assert verdict("matches", 0.5, [-40.0]) == "not established at 1 seed"


def test_a_claim_pairs_the_seeds_both_sides_ran_at_their_last_round(tmp_path):
    results_folder(tmp_path / "results" / "e1", {("conditional", 0): 0.90, ("conditional", 1): 0.92,
                   ("conditional", 2): 0.94, ("oracle", 0): 0.91, ("oracle", 1): 0.93, ("oracle", 2): 0.95,
                   ("oracle", 9): 0.50})  # fmt: skip
    claims = load_claims(claims_file(tmp_path, MATCHES))
    measured = measure(claims.claims[0], claims.claims[0].answers[0])
    # Seed 9 of Oracle alone is not paired; round 1's 0.1 is never read.
    assert measured.differences == pytest.approx((-1.0, -1.0, -1.0))
    assert (measured.subject_mean, measured.reference_mean) == pytest.approx((0.92, 0.93))
    assert measured.verdict == "does not hold"


def five_seeds(tmp_path: Path, subject: list[float], reference: list[float]) -> Path:
    """results/e1 beside a claims file: conditional and oracle end at these accuracies, seed by seed."""
    return results_folder(tmp_path / "results" / "e1", {
        **{("conditional", seed): value for seed, value in enumerate(subject)},
        **{("oracle", seed): value for seed, value in enumerate(reference)},
    })  # fmt: skip


def test_a_verdict_reads_exactly_the_declared_seeds_in_seed_order(tmp_path):
    # Seeds 0-2 (declared) are 1 point under Oracle: does not hold. Seeds 3-4 are 30 points under.
    five_seeds(tmp_path, [0.90, 0.91, 0.92, 0.60, 0.61], [0.91, 0.92, 0.93, 0.90, 0.91])
    claim = load_claims(claims_file(tmp_path, MATCHES)).claims[0]
    measured = measure(claim, claim.answers[0])
    assert measured.seeds == ("0", "1", "2") and measured.differences == pytest.approx((-1.0, -1.0, -1.0))
    assert (measured.subject_mean, measured.reference_mean) == pytest.approx((0.91, 0.92))
    assert measured.verdict == "does not hold" and not measured.pending
    # Declared 4: seeds 0-3, never a subset picked from the five.
    claim = load_claims(claims_file(tmp_path, MATCHES.replace("seeds = 3", "seeds = 4"))).claims[0]
    assert measure(claim, claim.answers[0]).seeds == ("0", "1", "2", "3")


def test_fewer_paired_seeds_than_declared_is_pending_with_no_verdict(tmp_path):
    # Two seeds 40 points under Oracle would not hold at any interval; seed 2 of conditional is not run,
    # and seed 3, run by both, does not stand in for it.
    five_seeds(tmp_path, [0.50, 0.51, math.nan, 0.52], [0.90, 0.91, 0.92, 0.93])
    claims = load_claims(claims_file(tmp_path, MATCHES))
    measured = measure(claims.claims[0], claims.claims[0].answers[0])
    assert measured.pending and measured.verdict == "pending: 2 of 3 declared seeds"
    assert measured.seeds == ("0", "1") and (measured.subject_missing, measured.reference_missing) == ((2,), ())
    assert "| -40.00 ± 0.00 | 2 of 3 | **pending: 2 of 3 declared seeds** |" in claims_table(claims, tmp_path)[2]
    assert pending_lines(claims) == ["- E1, federated: subject conditional, seed 2."]
    block = readme_block(claims, tmp_path, tmp_path / "REPRODUCTION.md")
    assert "- **In federated rounds**: pending: E1 (2 of 3 seeds)." in block


def test_seeds_beyond_the_declared_are_shown_post_hoc_and_never_move_the_verdict(tmp_path):
    # Seeds 0-2 straddle -0.5 (not established); seeds 3-4 would make all five hold.
    five_seeds(tmp_path, [0.903, 0.897, 0.903, 0.903, 0.903], [0.90] * 5)
    claims = load_claims(claims_file(tmp_path, MATCHES))
    measured = measure(claims.claims[0], claims.claims[0].answers[0])
    assert measured.verdict == "not established at 3 seeds"
    assert measured.differences == pytest.approx((0.3, -0.3, 0.3))
    assert verdict("matches", 0.5, [0.3, -0.3, 0.3, 0.3, 0.3]) == "holds"  # what all five would say
    assert measured.post_hoc_seeds == ("0", "1", "2", "3", "4")
    assert post_hoc_lines(claims) == [
        "- E1, federated: post hoc, over all 5 seeds both sides ran (seeds 3, 4 beyond the 3 declared): "
        "+0.18 ± 0.33 points."
    ]
    assert "| +0.10 ± 0.86 | 3 of 3 | **not established at 3 seeds** |" in claims_table(claims, tmp_path)[2]
    # No seed beyond the declared: nothing post hoc.
    five_seeds(tmp_path / "exact", [0.90, 0.91, 0.92], [0.90, 0.92, 0.92])
    exact = load_claims(claims_file(tmp_path / "exact", MATCHES))
    assert measure(exact.claims[0], exact.claims[0].answers[0]).post_hoc_seeds == () and post_hoc_lines(exact) == []


def test_a_beats_verdict_says_where_its_interval_lies_against_the_papers_range():
    paper = (1.5, 3.0)
    # The E4b interval that issue 64 found, +0.13 to +1.67: above 0, mostly below the paper's range.
    assert verdict("beats", 0.0, [0.13, 0.90, 1.67], paper) != "holds"
    assert verdict("beats", 0.0, [0.5, 0.6, 0.7], paper) == "holds: above 0, below the paper's +1.5-3"
    assert verdict("beats", 0.0, [2.0, 2.2, 2.4], paper) == "holds, within the paper's +1.5-3"
    assert verdict("beats", 0.0, [1.2, 1.6, 2.0], paper) == "holds: above 0, in part below the paper's +1.5-3"
    assert verdict("beats", 0.0, [2.6, 3.0, 3.4], paper) == "holds: above 0, in part above the paper's +1.5-3"
    assert verdict("beats", 0.0, [4.0, 4.2, 4.4], paper) == "holds: above 0 and above the paper's +1.5-3"
    assert verdict("beats", 0.0, [0.5, 2.0, 3.5], paper) == "not established at 3 seeds"
    assert verdict("beats", 0.0, [1.0, 2.25, 3.5, 1.0, 2.25, 3.5], paper) == (
        "holds: above 0, wider than the paper's +1.5-3"
    )
    # Without a range, or short of holding, the verdict is what it was.
    assert verdict("beats", 0.0, [0.5, 0.6, 0.7]) == "holds"
    assert verdict("beats", 0.0, [-0.5, -0.6, -0.7], paper) == "does not hold"


BEATS = MATCHES.replace('"Conditional matches Oracle"', '"Conditional beats Oracle (+1.5-3 points)"').replace(
    'kind = "matches"\nmargin = 0.5\n', 'kind = "beats"\npaper-range = [1.5, 3.0]\n'
)


def test_the_verdict_table_and_the_readme_say_where_a_beats_claim_lies_against_the_papers_range(tmp_path):
    five_seeds(tmp_path, [0.905, 0.906, 0.907], [0.90, 0.90, 0.90])
    claims = load_claims(claims_file(tmp_path, BEATS))
    assert claims.claims[0].paper_range == (1.5, 3.0)
    assert "**holds: above 0, below the paper's +1.5-3** |" in claims_table(claims, tmp_path)[2]
    block = readme_block(claims, tmp_path, tmp_path / "REPRODUCTION.md")
    assert "- **In federated rounds**: holds: E1 (3 seeds; above 0, below the paper's +1.5-3)." in block


@pytest.mark.parametrize(
    ("change", "readme", "refusal"),
    [
        (("seeds = 3\n", ""), False, "claim 1 (E1) declares no 'seeds'; add seeds = N"),
        (("seeds = 3", "seeds = 2"), False, "claim 1 (E1): seeds = 2 is too few; a claim needs at least 3: "
                                            "declare 3 or more"),
        (("seeds = 3", 'seeds = "3"'), False, "(E1): seeds = '3' is not a number; declare 3 or more"),
        ((None, None), True, "(E1): seeds = 3 is too few; a claim the README shows needs at least 5: "
                             "declare 5 or more"),
        (('experiment = "E1"', 'experiment = "E4b"'), False, "(E4b): seeds = 3 is too few; E4b needs at least 5"),
        (('reference = "oracle"', 'reference = "oracle"\nseeds = 5'), False,
         "seeds is declared once for the claim, not per protocol; move it out of [claim.federated]"),
    ],
    ids=["no seeds", "too few", "not a number", "shown in the README", "E4b", "per protocol"],
)  # fmt: skip
def test_a_claim_declaring_too_few_seeds_or_none_is_refused_in_one_line(tmp_path, change, readme, refusal):
    five_seeds(tmp_path, [0.9] * 5, [0.9] * 5)
    assert load_claims(claims_file(tmp_path, MATCHES)).claims[0].seeds == 3  # as written, accepted
    body = MATCHES.replace(*change) if change[0] else MATCHES
    with pytest.raises(FedcondError) as error:
        load_claims(claims_file(tmp_path, body), readme=readme)
    assert refusal in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (("[1.5, 3.0]", "[1.0, 6.0]"), "paper-range +1-6 is not the range its claim states"),
        (("[1.5, 3.0]", "[3.0, 1.5]"), "paper-range is [low, high] in points, low below high"),
        (('kind = "beats"', 'kind = "matches"'), "paper-range is for a 'beats' claim, not 'matches'; remove it"),
    ],
    ids=["not the claim's", "reversed", "on a matches claim"],
)
def test_a_paper_range_that_is_not_the_claims_is_refused(tmp_path, change, refusal):
    assert load_claims(claims_file(tmp_path, BEATS)).claims[0].paper_range == (1.5, 3.0)
    with pytest.raises(FedcondError, match=re.escape(refusal)):
        load_claims(claims_file(tmp_path, BEATS.replace(*change)))


def test_a_claims_file_with_a_mistake_is_refused_in_one_line(tmp_path):
    results_folder(tmp_path / "results" / "e1", {("conditional", 0): 0.9, ("oracle", 0): 0.9})
    with pytest.raises(FedcondError, match="kind 'equals' is not one of matches, beats"):
        load_claims(claims_file(tmp_path, MATCHES.replace('"matches"', '"equals"')))
    with pytest.raises(FedcondError, match="has no 'setting'; add it"):
        load_claims(claims_file(tmp_path, MATCHES.replace('setting = "digits"\n', "")))
    claims = load_claims(claims_file(tmp_path, MATCHES.replace('reference = "oracle"', 'reference = "ifca"')))
    with pytest.raises(FedcondError, match="no finished run of ifca"):
        measure(claims.claims[0], claims.claims[0].answers[0])


CHOICE = """
[[choice]]
shift = "label"
setting = "digits"
folders = ["results/a", "results/b"]
"""


def test_the_method_choice_ranks_federated_methods_by_their_named_variant_and_keeps_oracle_apart(tmp_path):
    scaled = {"label": "hyper-unit-zero", "method": "conditional", "fingerprint": "class-mean", "conditioning": "hyper",
              "condition-scale": "unit", "hyper-init": "zero", "server-momentum": 0.5}  # fmt: skip
    diagnostic = {"label": "half", "method": "conditional", "condition-scale": "half"}
    fedavgm = {"label": "fedavg-m", "method": "fedavg", "server-momentum": 0.5}
    results_folder(tmp_path / "results" / "a", {("fedavg", 0): 0.80, ("fedavg", 1): 0.81, ("fedavg", 2): 0.79,
                                                ("oracle", 0): 0.97, ("pooled-global", 0): 0.99,
                                                ("conditional", 0): 0.70, ("ifca", 0): 0.95})  # fmt: skip
    results_folder(
        tmp_path / "results" / "b",
        {(scaled["label"], 0): 0.90, (scaled["label"], 1): 0.88, (scaled["label"], 2): 0.89, ("oracle", 0): 0.96,
         ("oracle", 1): 0.95, ("half", 0): 0.99, ("fedavg-m", 0): 0.85},
        methods=[scaled, diagnostic, "oracle", fedavgm],
    )  # fmt: skip
    claims = load_claims(claims_file(tmp_path, CHOICE))
    ranked, reference = ranked_methods(claims.choices[0])
    # The labelled entry is the named variant recommended, its server optimiser set apart and shown;
    # FedAvg with FedAvgM is FedAvg, never mixed with the plain one; an unnamed diagnostic and the
    # pooled protocol are no choice; Oracle comes from the folder with more seeds.
    assert [(entry.method, entry.optimiser, entry.seeds) for entry in ranked] == [
        ("ifca", "", 1), ("recommended", "FedAvgM 0.5", 3), ("fedavg", "FedAvgM 0.5", 1), ("fedavg", "", 3),
        ("conditional", "", 1)
    ]  # fmt: skip
    assert reference is not None and (reference.method, reference.seeds) == ("oracle", 2)
    row = choice_table(claims, tmp_path)[2]
    # IFCA's one seed scores highest, and a one-seed ranking names no winner: best and runner-up are
    # the methods run at 3 seeds or more.
    assert "`recommended` (FedAvgM 0.5) 0.890 (3 seeds) | `fedavg` 0.800 (3 seeds) | +9.00 ± " in row
    assert "ifca" not in row and "`conditional` 0.700 (1 seed)" in row and "`oracle` 0.955 (2 seeds)" in row


def test_a_shift_without_two_methods_at_three_seeds_names_no_winner(tmp_path):
    results_folder(tmp_path / "results" / "a", {("fedavg", 0): 0.80, ("fedavg", 1): 0.81, ("fedavg", 2): 0.79,
                                                ("conditional", 0): 0.90, ("conditional", 1): 0.91})  # fmt: skip
    results_folder(tmp_path / "results" / "b", {("ifca", 0): 0.95})
    row = choice_table(load_claims(claims_file(tmp_path, CHOICE)), tmp_path)[2]
    assert "| not ranked: 1 method(s) at 3 seeds or more | — | — |" in row


def test_a_shift_whose_declared_folder_has_not_run_yet_is_pending_not_an_error(tmp_path):
    # results/a is a queued sweep's folder: it exists, its first run has not finished.
    (tmp_path / "results" / "a").mkdir(parents=True)
    results_folder(tmp_path / "results" / "b", {("ifca", 0): 0.95})
    row = choice_table(load_claims(claims_file(tmp_path, CHOICE)), tmp_path)[2]
    assert "(a, not run yet, [b](results/b)) | — | not ranked: 0 method(s) at 3 seeds or more |" in row
    nothing = CHOICE.replace('["results/a", "results/b"]', '["results/a"]')
    row = choice_table(load_claims(claims_file(tmp_path, nothing)), tmp_path)[2]
    assert "| not ranked: 0 method(s) at 3 seeds or more | — | — | not run | not run |" in row


def test_the_method_choice_ranks_on_validation_where_every_ranked_run_held_a_split_out(tmp_path):
    # fedavg's test accuracy is the higher, ifca's validation accuracy: validation names the best, and
    # the cells and the gap report test accuracy (here against the winner).
    finals = {**{("fedavg", seed): 0.90 for seed in range(3)}, **{("ifca", seed): 0.85 for seed in range(3)}}
    folder = results_folder(tmp_path / "results" / "a", finals, extra={"validation_accuracy": ""})
    with (folder / "metrics.csv").open("a", newline="") as handle:  # the validation split's final rounds
        writer = csv.DictWriter(handle, ["method", "seed", "round", "accuracy", "validation_accuracy"])
        for (method, seed), accuracy in finals.items():
            validation = 0.80 if method == "fedavg" else 0.84
            writer.writerow({"method": method, "seed": seed, "round": 3, "accuracy": accuracy,
                             "validation_accuracy": validation})  # fmt: skip
    single = CHOICE.replace('["results/a", "results/b"]', '["results/a"]')
    row = choice_table(load_claims(claims_file(tmp_path, single)), tmp_path)[2]
    assert "| validation | `ifca` 0.850 (3 seeds) | `fedavg` 0.900 (3 seeds) | -5.00 ± 0.00, 3 seeds |" in row
    # One run without a split: the whole row ranks on test accuracy, and says so.
    with (folder / "metrics.csv").open("a", newline="") as handle:
        csv.writer(handle).writerow(["ifca", 3, 3, 0.85, ""])
    row = choice_table(load_claims(claims_file(tmp_path, single)), tmp_path)[2]
    assert "| test (no validation split) | `fedavg` 0.900 (3 seeds) | `ifca` 0.850 (4 seeds) |" in row


def test_a_choice_over_folders_of_different_settings_is_refused(tmp_path):
    results_folder(tmp_path / "results" / "a", {("fedavg", 0): 0.8, ("conditional", 0): 0.7})
    results_folder(tmp_path / "results" / "b", {("fedavg", 0): 0.8}, settings={"dataset": "mnist"})
    claims = load_claims(claims_file(tmp_path, CHOICE))
    with pytest.raises(FedcondError, match="its folders ran different settings"):
        ranked_methods(claims.choices[0])


def test_the_readme_block_is_replaced_between_its_markers_only(tmp_path):
    text = f"intro\n{README_BEGIN}\nold\n{README_END}\nrest\n"
    assert with_readme_block(text, f"{README_BEGIN}\nnew\n{README_END}", tmp_path) == (
        f"intro\n{README_BEGIN}\nnew\n{README_END}\nrest\n"
    )
    with pytest.raises(FedcondError, match="needs one line"):
        with_readme_block("no markers\n", "x", tmp_path)


def test_the_reproduction_heads_its_report_with_the_claims_and_rewrites_only_the_readmes_block(tmp_path, capsys):
    from tests.test_paper import metrics_rows
    from tests.test_paper import results_folder as paper_results_folder
    from tools.reproduction import main

    # Conditional ends at 0.90 / 0.92 on seeds 0 / 1, FedAvg at 0.50 / 0.50.
    folder = paper_results_folder(tmp_path / "results" / "e1", metrics_rows())
    (tmp_path / "reproduction-notes.md").write_text("notes\n")
    readme = tmp_path / "README.md"
    readme.write_text("intro\n")
    out = tmp_path / "REPRODUCTION.md"
    # No claims file beside the report: --readme has no verdicts to write, and nothing is written.
    assert main([str(folder), "--out", str(out), "--readme", str(readme)]) == 2
    assert "pass --claims FILE" in capsys.readouterr().err and not out.exists()
    (tmp_path / "paper").mkdir()
    claims = MATCHES.replace('"results/e1"', '"../results/e1"').replace('"oracle"', '"fedavg"')
    claims_file(tmp_path / "paper", claims)
    readme.write_text(f"intro\n{README_BEGIN}\n{README_END}\nrest\n")
    # Three seeds declared are enough for the report alone, not for the README's verdicts.
    assert main([str(folder), "--out", str(out), "--readme", str(readme)]) == 2
    assert "a claim the README shows needs at least 5" in capsys.readouterr().err and not out.exists()
    claims_file(tmp_path / "paper", claims.replace("seeds = 3", "seeds = 5"))
    readme.write_text("intro\n")
    # A README without the markers is refused before the report is written.
    assert main([str(folder), "--out", str(out), "--readme", str(readme)]) == 2
    assert "needs one line" in capsys.readouterr().err and not out.exists()
    readme.write_text(f"intro\n{README_BEGIN}\n{README_END}\nrest\n")
    assert main([str(folder), "--out", str(out), "--readme", str(readme)]) == 0
    report = out.read_text()
    first = report.splitlines()[0]
    assert first.startswith("<!-- generated by python -m tools.reproduction: do not edit; regenerate with `python -m "
                            "tools.reproduction ") and first.endswith(" --readme README.md` -->")  # fmt: skip
    assert "## The paper's claims: our verdicts" in report
    # Two of the five declared seeds: pending, the seeds to run listed; no verdict.
    row = "| conditional 0.910 | fedavg 0.500 | +41.00 ± 12.71 | 2 of 5 | **pending: 2 of 5 declared seeds** |"
    assert row in report
    assert "- E1, federated: subject conditional, seeds 2-4; reference fedavg, seeds 2-4." in report
    text = readme.read_text()
    assert text.startswith(f"intro\n{README_BEGIN}\n") and text.endswith(f"{README_END}\nrest\n")
    assert "**In federated rounds**: pending: E1 (2 of 5 seeds)." in text


def test_the_installed_reproduction_leaves_the_report_with_the_verdicts_alone(tmp_path, capsys):
    """``fedcond reproduction`` (installed, no claims) would drop the checkout's verdicts: it refuses a
    report ``python -m tools.reproduction`` wrote; that one takes over a report of the installed one."""
    from fedcond.tools.cli import main as fedcond
    from tests.test_paper import metrics_rows
    from tests.test_paper import results_folder as paper_results_folder
    from tools.reproduction import main

    folder = paper_results_folder(tmp_path / "results" / "e1", metrics_rows())
    (tmp_path / "reproduction-notes.md").write_text("notes\n")
    out = tmp_path / "REPRODUCTION.md"
    assert fedcond(["reproduction", str(folder), "--out", str(out)]) == 0
    assert out.read_text().startswith("<!-- generated by fedcond reproduction: ")
    assert main([str(folder), "--out", str(out)]) == 0
    written = out.read_text()
    assert written.startswith("<!-- generated by python -m tools.reproduction: ")
    capsys.readouterr()
    assert fedcond(["reproduction", str(folder), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was generated by another command, which its first line names" in err
    assert out.read_text() == written


COMPARISON = """
[[comparison]]
experiment = "E4b"
question = "the recommended method against Oracle"
seeds = 3
headline = true
folder = "results/e4b"
setting = "digits"
subject = "recommended"
reference = "oracle"
score = "newcomers"
"""


def test_a_comparison_is_pending_until_its_declared_seeds_run_then_says_which_way_it_falls(tmp_path):
    # Declared before its runs: no folder yet is pending at 0 of 3, not an error.
    claims = load_claims(claims_file(tmp_path, COMPARISON))
    (measured,) = claims.compared
    assert measured.verdict == "pending: 0 of 3 declared seeds" and measured.subject_missing == (0, 1, 2)
    # Participants level on every seed; the reference's newcomers (heldout_accuracy) 2 points higher.
    folder = results_folder(tmp_path / "results" / "e4b", {(m, seed): 0.9 for m in ("recommended", "oracle")
                                                           for seed in range(3)})  # fmt: skip
    with (folder / "metrics.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    with (folder / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, [*rows[0], "heldout_accuracy"])
        writer.writeheader()
        writer.writerows(row | {"heldout_accuracy": 0.52 if row["method"] == "oracle" else 0.5} for row in rows)
    (measured,) = load_claims(claims_file(tmp_path, COMPARISON)).compared
    assert measured.differences == pytest.approx((-2.0, -2.0, -2.0)) and measured.verdict == "below"
    (participants,) = load_claims(claims_file(tmp_path, COMPARISON.replace("newcomers", "participants"))).compared
    assert participants.differences == pytest.approx((0.0, 0.0, 0.0))
    assert participants.verdict == "not established at 3 seeds"
    assert verdict("compares", 0.0, [1.0, 1.2, 1.4]) == "above"
    assert verdict("compares", 0.0, [-0.1, 0.2, 0.5]) == "not established at 3 seeds"


def test_a_comparison_goes_into_the_reproduction_and_the_readme_when_it_is_a_headline(tmp_path):
    results_folder(tmp_path / "results" / "e4b", {("recommended", 0): 0.91, ("oracle", 0): 0.90})
    claims = load_claims(claims_file(tmp_path, COMPARISON.replace("newcomers", "participants")))
    section = "\n".join(verdicts_markdown(claims, tmp_path))
    assert "## Like for like: the declared comparisons" in section
    assert "| recommended 0.910 | oracle 0.900 | +1.00 | 1 of 3 | **pending: 1 of 3 declared seeds** |" in section
    assert "| E4b: the recommended method against Oracle | participants | digits ([e4b](results/e4b)) |" in section
    assert (
        "- E4b: the recommended method against Oracle: subject recommended, seeds 1, 2; reference oracle, seeds 1, 2."
        in section
    )
    block = readme_block(claims, tmp_path, tmp_path / "REPRODUCTION.md")
    assert "E4b the recommended method against Oracle: pending (1 of 3 seeds)" in block
    hidden = load_claims(claims_file(tmp_path, COMPARISON.replace("headline = true", "headline = false")))
    assert "Like for like" not in readme_block(hidden, tmp_path, tmp_path / "REPRODUCTION.md")


@pytest.mark.parametrize(
    ("change", "readme", "refusal"),
    [
        (("score = ", "scores = "), False, "unknown keys ['scores']"),
        (('"newcomers"', '"everyone"'), False, "score 'everyone' is not one of participants, newcomers"),
        (("seeds = 3", "seeds = 2"), False, "seeds = 2 is too few"),
        ((None, None), True, "seeds = 3 is too few; a claim the README shows needs at least 5"),
    ],
    ids=["unknown key", "unknown score", "too few seeds", "a headline in the README"],
)
def test_a_comparison_with_a_mistake_is_refused_in_one_line(tmp_path, change, readme, refusal):
    assert load_claims(claims_file(tmp_path, COMPARISON)).comparisons[0].seeds == 3  # as written, accepted
    body = COMPARISON.replace(*change) if change[0] else COMPARISON
    with pytest.raises(FedcondError) as error:
        load_claims(claims_file(tmp_path, body), readme=readme)
    assert refusal in str(error.value) and "\n" not in str(error.value)

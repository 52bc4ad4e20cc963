"""The verdict table and the method-choice table: each claim's paired difference, its interval and
the verdict they allow, computed from a results folder's metrics.csv (fedcond.tools.claims)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from fedcond.errors import FedcondError
from fedcond.tools.claims import (
    README_BEGIN,
    README_END,
    choice_table,
    load_claims,
    measure,
    ranked_methods,
    verdict,
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
                   ("oracle", 0): 0.91, ("oracle", 1): 0.93, ("oracle", 2): 0.50})  # fmt: skip
    claims = load_claims(claims_file(tmp_path, MATCHES))
    measured = measure(claims.claims[0], claims.claims[0].answers[0])
    # Seed 2 of Oracle alone is not paired; round 1's 0.1 is never read.
    assert measured.differences == pytest.approx((-1.0, -1.0))
    assert (measured.subject_mean, measured.reference_mean) == pytest.approx((0.91, 0.92))
    assert measured.verdict == "does not hold"


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
    scaled = {"label": "hyper-unit-zero", "method": "conditional", "fingerprint": "class-mean",
              "conditioning": "hyper", "condition-scale": "unit", "hyper-init": "zero"}  # fmt: skip
    diagnostic = {"label": "half", "method": "conditional", "condition-scale": "half"}
    results_folder(tmp_path / "results" / "a", {("fedavg", 0): 0.80, ("oracle", 0): 0.97, ("pooled-global", 0): 0.99,
                                                ("conditional", 0): 0.70})  # fmt: skip
    results_folder(
        tmp_path / "results" / "b",
        {(scaled["label"], 0): 0.90, (scaled["label"], 1): 0.88, ("oracle", 0): 0.96, ("oracle", 1): 0.95,
         ("half", 0): 0.99},
        methods=[scaled, diagnostic, "oracle"],
    )  # fmt: skip
    claims = load_claims(claims_file(tmp_path, CHOICE))
    ranked, reference = ranked_methods(claims.choices[0])
    # The labelled entry is the named variant scaled-hyper; an unnamed diagnostic and the pooled
    # protocol are no choice; Oracle comes from the folder with more seeds.
    assert [(entry.method, entry.seeds) for entry in ranked] == [("scaled-hyper", 2), ("fedavg", 1), ("conditional", 1)]
    assert reference is not None and (reference.method, reference.seeds) == ("oracle", 2)
    row = choice_table(claims, tmp_path)[2]
    assert "`scaled-hyper` 0.890 (2 seeds)" in row and "+10.00, 1 seed" in row and "`oracle` 0.955 (2 seeds)" in row


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
    from fedcond.tools.cli import main
    from tests.test_paper import metrics_rows
    from tests.test_paper import results_folder as paper_results_folder

    # Conditional ends at 0.90 / 0.92 on seeds 0 / 1, FedAvg at 0.50 / 0.50.
    folder = paper_results_folder(tmp_path / "results" / "e1", metrics_rows())
    (tmp_path / "reproduction-notes.md").write_text("notes\n")
    readme = tmp_path / "README.md"
    readme.write_text("intro\n")
    out = tmp_path / "REPRODUCTION.md"
    # No claims file beside the report: --readme has no verdicts to write, and nothing is written.
    assert main(["reproduction", str(folder), "--out", str(out), "--readme", str(readme)]) == 2
    assert "pass --claims FILE" in capsys.readouterr().err and not out.exists()
    (tmp_path / "paper").mkdir()
    claims_file(tmp_path / "paper", MATCHES.replace('"results/e1"', '"../results/e1"').replace('"oracle"', '"fedavg"'))
    # A README without the markers is refused before the report is written.
    assert main(["reproduction", str(folder), "--out", str(out), "--readme", str(readme)]) == 2
    assert "needs one line" in capsys.readouterr().err and not out.exists()
    readme.write_text(f"intro\n{README_BEGIN}\n{README_END}\nrest\n")
    assert main(["reproduction", str(folder), "--out", str(out), "--readme", str(readme)]) == 0
    report = out.read_text()
    assert "## The paper's claims: our verdicts" in report
    assert "| conditional 0.910 | fedavg 0.500 | +41.00 ± 12.71 | 2 | **holds** |" in report
    text = readme.read_text()
    assert text.startswith(f"intro\n{README_BEGIN}\n") and text.endswith(f"{README_END}\nrest\n")
    assert "**In federated rounds**: holds: E1 (2)." in text

"""Numbers in hand-written prose that cite their runs hold (``tools/prose_numbers.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.prose_numbers import problems

ROOT = Path(__file__).resolve().parents[1]
PROSE = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("experiments/*.md")])

BLOCK = """Scaled-hyper ends at 0.839 over three seeds, Oracle at 0.849 (0.8486 ± 0.0090): -0.98 ± 0.91 points
(within half a point of Oracle: not established); Oracle's seed 0 reads 0.8355 at round 15 and 0.846 over its
last five; the paper's Gossip on MNIST K=2, 0.691; pFedHN at its 0.002; Oracle's CNN has 1,115,555 parameters.
<!-- cites experiments/results/e4b-conditioning where configuration=C=2
hyper-unit-zero mean: 0.839
oracle mean: 0.849
oracle interval: 0.8486 ± 0.0090
hyper-unit-zero - oracle: -0.98 ± 0.91
hyper-unit-zero - oracle verdict matches 0.5: not established
oracle seed 0 round 15: 0.8355
oracle seed 0 rounds 16-20: 0.846
paper IV Gossip dataset=MNIST k=2: 0.691
default pfedhn-lr: 0.002
oracle parameters: 1,115,555
-->
"""


@pytest.mark.parametrize("path", PROSE, ids=[str(path.relative_to(ROOT)) for path in PROSE])
def test_every_cited_number_is_what_its_runs_say(path):
    assert problems(path, ROOT) == []


def write(tmp_path: Path, text: str) -> Path:
    """A page of prose in the test's folder; its citations name folders from the repository's root."""
    path = tmp_path / "page.md"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (("at 0.849", "at 0.850"), "0.849 (oracle mean) is not in the text above it"),
        (("0.849", "0.848"), "oracle mean: 0.848 is not what the runs say: the runs give 0.848"),
        (("-0.98 ± 0.91", "-0.98 ± 0.19"), "not what the runs say: the runs give -0.9"),
        (("round 15: 0.8355", "round 14: 0.8355"), "oracle seed 0 round 14: 0.8355 is not what the runs say"),
        (("over three seeds,", "over three seeds (worst 0.7731),"), "0.7731 is in a citing text and not cited"),
        (("0.691", "0.692"), "is not what the runs say: the paper's rows give 0.691"),
        (("0.002", "0.003"), "default pfedhn-lr: 0.003 is not what the runs say: its default is 0.002"),
        (("± 0.0090", "± 0.0900"), "oracle interval: 0.8486 ± 0.0900 is not what the runs say: the runs give"),
        (("16-20: 0.846", "15-20: 0.846"), "oracle seed 0 rounds 15-20: 0.846 is not what the runs say: the run gives"),
        # The text alone changed (the cites comment as it was): each number tied to its place and name.
        (
            ("at 0.839 over three seeds, Oracle at 0.849", "at 0.849 over three seeds, Oracle at 0.839"),
            "0.849 (oracle mean) is out of order: the text shows it before 0.839 (hyper-unit-zero mean)",
        ),
        (
            ("-0.98 ± 0.91 points", "-0.98 ± 0.19 points"),
            "-0.98 ± 0.91 (hyper-unit-zero - oracle) is not in the text above it: the text shows 0.98 ± 0.19, another",
        ),
        (
            ("-0.98 ± 0.91 points", "+0.98 ± 0.91 points"),
            "-0.98 ± 0.91 (hyper-unit-zero - oracle): the text reads +0.98 ± 0.91, the other sign",
        ),
        (
            ("-0.98 ± 0.91 points", "0.98 ± 0.91 points"),
            "-0.98 ± 0.91 (hyper-unit-zero - oracle): the text reads +0.98 ± 0.91, the other sign",
        ),
        (("-0.98 ± 0.91 points", "0.98 ± 0.91 points above Oracle"), "the text reads +0.98 ± 0.91, the other sign"),
        (
            ("Oracle: not established)", "Oracle: holds)"),
            "not established (hyper-unit-zero - oracle verdict matches 0.5) is not in the text above it",
        ),
        (
            ("not established", "holds"),
            "hyper-unit-zero - oracle verdict matches 0.5: holds is not what the runs say: "
            "the runs give not established at 3 seeds",
        ),
        (
            ("has 1,115,555 parameters", "has 1,115,565 parameters"),
            "1,115,555 (oracle parameters) is not in the text above it",
        ),
        (("1,115,555", "1,115,565"), "oracle parameters: 1,115,565 is not what the runs say: the runs give 1,115,555"),
    ],
    ids=[
        "not in the text",
        "another mean",
        "another interval",
        "another round",
        "an uncited number",
        "the paper's",
        "a default",
        "an interval",
        "a mean of rounds",
        "a swapped pair",
        "another width in the text",
        "a flipped sign",
        "a dropped minus",
        "a minus worded the other way",
        "another verdict in the text",
        "another verdict",
        "another parameter count in the text",
        "another parameter count",
    ],
)
def test_a_wrong_or_uncited_number_is_named_with_its_line(tmp_path, change, complaint):
    path = write(tmp_path, BLOCK)
    assert problems(path, ROOT) == []  # as written, every number holds
    path.write_text(BLOCK.replace(*change))
    found = problems(path, ROOT)
    assert any(complaint in line for line in found), found


@pytest.mark.parametrize(
    "change",
    [
        ("-0.98 ± 0.91 points\n(within", "0.98 ± 0.91 points under\nOracle (within"),
        ("): -0.98 ± 0.91 points", "), Oracle costs it 0.98 ± 0.91 points"),
        ("at 0.849 (0.8486", "at 0.849 (0.849 over three seeds, 0.8486"),
        ("1,115,555 parameters.", "1,115,555 parameters, as DAC's 1,115,555."),
    ],
    ids=["a minus worded after it", "a minus worded before it", "a value quoted twice", "a count quoted twice"],
)
def test_a_worded_sign_or_a_repeated_value_is_no_problem(tmp_path, change):
    path = write(tmp_path, BLOCK.replace(*change))
    assert problems(path, ROOT) == []


def test_two_lines_quoting_one_value_may_share_its_place_in_the_text(tmp_path):
    text = """Oracle and DAC both have 1,115,555 parameters.
<!-- cites experiments/results/e4b-conditioning where configuration=C=2
oracle parameters: 1,115,555
dac parameters: 1,115,555
-->
"""
    path = write(tmp_path, text)
    assert problems(path, ROOT) == []
    # A count the runs of one method do not share, or a method without runs, is named.
    path.write_text(text.replace("dac parameters", "pfedhn parameters"))
    assert any("pfedhn parameters: 1,115,555 is not what the runs say: no such finished run" in line
               for line in problems(path, ROOT))  # fmt: skip


def test_suggest_finds_the_runs_that_give_each_number_of_an_uncited_text(tmp_path):
    from tools.prose_numbers import suggest

    path = write(tmp_path, "Initialised at random 0.8413, at zero 0.8408; the paper says 0.9999.\n")
    lines = suggest(path, 1, ROOT / "experiments/results/e4b-conditioning", {"configuration": "C=2"})
    assert "hyper-unit seed 0: 0.8413" in lines and "hyper-unit-zero seed 0: 0.8408" in lines
    assert "# 0.9999: no run of e4b-conditioning gives it" in lines


def test_no_text_quotes_a_number_it_does_not_cite():
    """Every text of the README, docs and notes that quotes a number of three or more decimals cites
    its runs or says it was measured outside the committed results."""
    from tools.prose_numbers import uncited

    found = [(path, line, numbers) for path in PROSE if path.name != "REPRODUCTION.md"
             for line, numbers in uncited(path, ROOT)]  # fmt: skip
    listing = "\n".join(f"{path.relative_to(ROOT)}:{line}: {' '.join(numbers[:4])}" for path, line, numbers in found)
    assert not found, f"cite these runs (docs/running.md says how):\n{listing}"


def test_an_uncited_text_is_found_and_a_cited_or_outside_one_is_not(tmp_path):
    from tools.prose_numbers import uncited

    path = write(tmp_path, "Ends at 0.8481.\n\nA run outside: 0.9123.\n<!-- outside: python x.py -->\n\n" + BLOCK)
    assert uncited(path, ROOT) == [(1, ["0.8481"])]


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("""The digits default ends at 0.644.
<!-- cites experiments/results/instability/rounds.csv by variant where configuration=digits-e1-k5
default seed 0: 0.644
-->
""", "0.644"),
        ("""CFL at the authors' thresholds ends at 0.953.
<!-- cites experiments/results/cfl-own-setting by variant
"CFL (authors' eps 0.4 / 1.6)" seed 0: 0.953
-->
""", "0.953"),
    ],
    ids=["a CSV of runs, by its own method column", "a grid label with spaces, in double quotes"],
)  # fmt: skip
def test_another_source_of_runs_is_cited_as_a_results_folder_is(tmp_path, text, number):
    path = write(tmp_path, text)
    assert problems(path, ROOT) == []
    path.write_text(text.replace(number, number[:-1] + str(int(number[-1]) + 1)))
    assert any(f"the run gives {number}" in line for line in problems(path, ROOT))


SEEDS_NAMED = """Over the two seeds declared first it is -1.06 ± 4.26 points from Oracle (not established); over all
three, -0.98 ± 0.91.
<!-- cites experiments/results/e4b-conditioning where configuration=C=2
hyper-unit-zero - oracle over seeds 0,1: -1.06 ± 4.26
hyper-unit-zero - oracle over seeds 0,1 verdict matches 0.5: not established
hyper-unit-zero - oracle: -0.98 ± 0.91
-->
"""


def test_a_paired_difference_over_named_seeds_uses_those_seeds_alone(tmp_path):
    """A claim's declared seeds, cited apart from seeds run after it (post hoc): the interval over seeds
    0,1 is not the one over all three, and quoting one for the other fails."""
    path = write(tmp_path, SEEDS_NAMED)
    assert problems(path, ROOT) == []
    path.write_text(SEEDS_NAMED.replace("over seeds 0,1: -1.06 ± 4.26", "over seeds 0,1: -0.98 ± 0.91"))
    assert any("the runs give -1.0650 ± 4.2566 points (2 seeds)" in line for line in problems(path, ROOT))

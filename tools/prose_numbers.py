"""Numbers in hand-written prose, checked against the committed runs they come from.

A paragraph or table that quotes runs ends with a comment naming its results folder and, one per
line, each number it quotes and where it comes from::

    <!-- cites experiments/results/e4b-conditioning where configuration=C=2
    oracle seed 0: 0.848
    oracle seed 0 round 15: 0.8355
    scaled-hyper mean: 0.839
    hyper-unit-zero - oracle: -0.98 ± 0.91
    hyper-unit-zero - oracle verdict matches 0.5: not established
    oracle parameters: 1,115,555
    -->

A line is ``METHOD seed S [round R] [COLUMN]: VALUE`` (that run's COLUMN, accuracy unless named, in
round R, its last recorded one unless named), ``METHOD mean [over seeds 0,1] [COLUMN]: VALUE`` (the
mean over its seeds, or those named, of the last recorded values), ``METHOD interval [over seeds 0,1]
[COLUMN]: M ± H`` (that mean and its 95% t half-width), ``METHOD - REFERENCE [over seeds 0,1]
[COLUMN]: D ± H`` (the paired mean difference in points over the seeds both ran, or those of them
named, and its 95% t half-width), or ``METHOD - REFERENCE [over seeds 0,1] [COLUMN] verdict
[matches MARGIN]: WORDS`` (what that paired interval allows,
worded as the verdict table words it, ``tools.claims.verdict``: holds, does not hold, not
established; above 0, or no more than MARGIN points under with ``matches``), ``METHOD [seed S]
parameters: N`` (the model's size, run.json's ``model_parameters``, the same in each of its runs),
``paper TABLE METHOD [column=value ...]: VALUE`` (a number of the paper's, experiments/paper/results.csv),
or ``default SETTING: VALUE`` (a setting's default, as declared).
METHOD is the method column of the folder's metrics.csv (a grid label). ``where`` picks rows by
other columns.

``problems`` compares each quoted number with the runs at the precision it is printed with, and
fails where a number is not in the text it follows, where the runs give another, and where the
text holds a number with three or more decimals that no line cites: such a block's numbers are all
checked or none is. What a line quotes is tied to its place in the text:

- in order: the text shows the quoted values in the order the lines cite them (each found after the
  one cited before it), so two numbers swapped in the text ("Oracle at 0.839, scaled-hyper 0.849"
  against lines citing scaled-hyper's 0.839, then Oracle's 0.849) are out of order. The order of
  appearance is what ties a number to its name without a dictionary of how prose names each method;
- whole: an interval shows as ``M ± H``, its width included; a verdict as its words; a count of
  parameters as printed (``1,115,555``);
- signed: a paired difference shows its sign (``-0.98``, ``+0.98``), or, unsigned, a word that gives
  it: right after it ("0.98 points under", "0.41 ± 1.78 above"), else the nearest before it in its
  sentence ("costs newcomers 21.05 ± 13.50"); unsigned with no such word, it reads positive, so a
  minus dropped ("-0.98" become "0.98") is found as a flip is. A difference that rounds to 0 is not
  checked.
"""

from __future__ import annotations

import csv
import math
import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedcond.errors import FedcondError
from fedcond.tools.report import confidence_half_width
from tools.claims import Side, final_by_seed, metrics_rows, verdict

OPENING = "<!-- cites "
#: A text whose numbers were measured outside the committed results says so, and how to measure
#: them again, in a comment right below it: ``<!-- outside: python benchmarks/x.py --out DIR -->``.
OUTSIDE = "<!-- outside: "
#: Numbers a block must cite once it cites any: three or more decimals (accuracies, losses).
#: (A setting written key=value is not a result: a number right after "=" is not one of them.)
PRECISE = re.compile(r"(?<![\w.=])\d+\.\d{3,}(?!\w)(?!\.\d)")  # a sentence's full stop may follow
#: An arXiv identifier (2603.11307) is a name, not a number.
_ARXIV = re.compile(r"arXiv\s+\d{4}\.\d{4,5}")


def _named(method: str) -> str:
    return method[1:-1] if method.startswith('"') else method


def precise_numbers(text: str) -> list[str]:
    """The numbers of ``text`` with three or more decimals, as printed."""
    return PRECISE.findall(_ARXIV.sub("", text))


#: A method is one word, or a grid label with spaces in double quotes ("CFL (eps 0.4)").
_NAME = r'(?:"[^"]+"|\S+)'
_RUN = re.compile(
    rf"^(?P<method>{_NAME}) seed (?P<seed>\S+)"
    r"(?: round (?P<round>\d+)| rounds (?P<first>\d+)-(?P<last>\d+))?(?: (?P<column>[a-z_]+))?$"
)
_OVER_SEEDS = re.compile(
    rf"^(?P<method>{_NAME}) (?P<kind>mean|interval)(?: over seeds (?P<seeds>\d+(?:,\d+)*))?(?: (?P<column>[a-z_]+))?$"
)
_DEFAULT = re.compile(r"^default (?P<key>[a-z0-9-]+)$")
_PAPER = re.compile(r"^paper (?P<table>[IVXL]+) (?P<method>\S+)(?P<filters>(?: [a-z_]+=\S+)*)$")
_PAPER_RESULTS = "experiments/paper/results.csv"
_SEEDS = r"(?: over seeds (?P<seeds>\d+(?:,\d+)*))?"
_PAIRED = re.compile(rf"^(?P<method>{_NAME}) - (?P<reference>{_NAME}){_SEEDS}(?: (?P<column>[a-z_]+))?$")
_VERDICT = re.compile(
    rf"^(?P<method>{_NAME}) - (?P<reference>{_NAME}){_SEEDS}(?: (?P<column>[a-z_]+))? verdict"
    r"(?: (?P<kind>beats|matches (?P<margin>\d+(?:\.\d+)?)))?$"
)
_PARAMETERS = re.compile(rf"^(?P<method>{_NAME})(?: seed (?P<seed>\d+))? parameters$")
#: How a verdict line's words may read: the verdict table's outcomes (``tools.claims.OUTCOMES``).
VERDICT_WORDS = ("holds", "does not hold", "not established")
#: Words that give an unsigned difference its sign.
UNDER = ("under", "below", "behind", "short", "less", "lower", "lose", "loses", "lost", "cost", "costs", "worse")
ABOVE = ("above", "add", "adds", "gain", "gains", "higher", "ahead", "better", "beats", "exceeds")
_DIRECTION = re.compile(r"\b(" + "|".join((*UNDER, *ABOVE)) + r")\b")
_MINUS = "-\u2212"  # a hyphen-minus, or the minus sign


@dataclass(frozen=True)
class Citation:
    """One quoted number: the file and line of its comment, what it says it is, and the text quoted."""

    path: Path
    line: int
    source: str
    quoted: str


@dataclass(frozen=True)
class Block:
    """The text a cites comment follows (from the last blank line before it), its folder and rows filter."""

    path: Path
    #: The text's first line (1-based): the citations of one text share it.
    line: int
    text: str
    folder: Path
    where: dict[str, str]
    citations: tuple[Citation, ...]
    #: The column that names the method (a results folder's metrics.csv: ``method``).
    by: str = "method"
    #: The repository the folders are named from (where experiments/paper/results.csv lives).
    root: Path = Path(".")

    def rows(self) -> list[dict[str, str]]:
        """The rows the citations read: a results folder's metrics.csv, or a CSV file of runs named
        in the comment (a file without seeds is seed 0); ``by COLUMN`` names the column that names
        the method, ``by A/B`` joins two."""
        if self.folder.suffix != ".csv":
            rows = metrics_rows(self.folder)
        else:
            with self.folder.open(newline="") as handle:
                rows = [{"seed": "0", "round": "0", **row} for row in csv.DictReader(handle)]
        if self.by == "method":
            return rows
        named = self.by.split("/")
        return [{**row, "method": "/".join(row.get(column, "") for column in named)} for row in rows]


def blocks(path: Path, root: Path) -> Iterator[Block]:
    """Every cites comment of ``path`` with the text it follows; folders are relative to ``root``."""
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        if not lines[index].startswith(OPENING):
            index += 1
            continue
        start = index
        header = shlex.split(lines[index][len(OPENING) :])
        if not header:
            raise FedcondError(f"{path}:{index + 1}: a cites comment names no results folder")
        folder, where, by = root / header[0], {}, "method"
        rest = header[1:]
        if rest[:1] == ["by"] and len(rest) > 1:
            by, rest = rest[1], rest[2:]
        if rest[:1] == ["where"]:
            for pair in rest[1:]:
                key, _, value = pair.partition("=")
                where[key] = value
        citations = []
        index += 1
        while index < len(lines) and lines[index].strip() != "-->":
            source, separator, quoted = lines[index].rpartition(":")
            if not separator:
                raise FedcondError(f"{path}:{index + 1}: a cited number is 'what: value', got '{lines[index]}'")
            citations.append(Citation(path, index + 1, source.strip(), quoted.strip()))
            index += 1
        # The text is the lines above, back to a blank line; comments right above it (another
        # folder's citations of the same text) are stepped over.
        text_end = start
        while text_end > 0 and lines[text_end - 1].strip() == "-->":
            while text_end > 0 and not lines[text_end - 1].startswith(OPENING):
                text_end -= 1
            text_end -= 1
        text_start = text_end
        while text_start > 0 and lines[text_start - 1].strip():
            text_start -= 1
        text = "\n".join(lines[text_start:text_end])
        yield Block(path, text_start + 1, text, folder, where, tuple(citations), by, root)
        index += 1


def _decimals(text: str) -> int:
    return len(text.split(".")[1]) if "." in text else 0


def _same(quoted: str, value: float) -> bool:
    """Whether ``quoted`` (a number as printed) is ``value`` at that precision."""
    return math.isfinite(value) and float(quoted) == round(value, _decimals(quoted))


def _same_interval(quoted: str, mean: float, half: float) -> bool:
    """Whether ``quoted`` ("M ± H") is ``mean`` and ``half`` at the precision each is printed with."""
    parts = quoted.replace("±", " ").split()
    return len(parts) == 2 and _same(parts[0], mean) and _same(parts[1], half)


def measured(block: Block, citation: Citation) -> str | None:
    """Why ``citation`` does not hold (None: it does)."""
    if match := _PAPER.match(citation.source):
        return _paper_value(block, match, citation.quoted)
    if match := _DEFAULT.match(citation.source):
        from fedcond.tools.flwr_commands import default_config

        defaults = default_config()
        if match["key"] not in defaults:
            return f"no setting is called {match['key']}"
        value = defaults[match["key"]]
        return None if _same(citation.quoted, float(value)) else f"its default is {value}"
    if match := _PARAMETERS.match(citation.source):
        return _parameters(block, match, citation.quoted)
    rows = block.rows()
    if match := _VERDICT.match(citation.source):
        column = match["column"] or "accuracy"
        subject = final_by_seed(rows, Side(_named(match["method"]), block.where), column)
        reference = final_by_seed(rows, Side(_named(match["reference"]), block.where), column)
        seeds = _paired_seeds(subject, reference, match["seeds"])
        differences = [100 * (subject[seed] - reference[seed]) for seed in seeds]
        kind, margin = ("matches", float(match["margin"])) if match["margin"] else ("beats", 0.0)
        said = verdict(kind, margin, differences)
        if citation.quoted not in VERDICT_WORDS and not citation.quoted.startswith("not established at "):
            return f"a verdict is quoted as one of {', '.join(VERDICT_WORDS)}"
        if said == citation.quoted or said.startswith(citation.quoted + " at "):
            return None
        return f"the runs give {said} ({len(seeds)} seeds paired, {kind}{f' {margin:g}' * (kind == 'matches')})"
    if match := _RUN.match(citation.source):
        side = Side(_named(match["method"]), {**block.where, "seed": match["seed"]})
        column = match["column"] or "accuracy"
        if match["first"]:  # the mean of a run's rounds first..last (a single seed's rounds swing)
            rounds = range(int(match["first"]), int(match["last"]) + 1)
            by_round = [list(final_by_seed(rows, Side(side.method, {**side.where, "round": str(number)}),
                                           column).values()) for number in rounds]  # fmt: skip
            if not rounds or not all(by_round):
                return f"the run has not every round of {match['first']}-{match['last']}"
            mean = float(np.mean([values[0] for values in by_round]))
            return None if _same(citation.quoted, mean) else f"the run gives {mean:.6g}"
        if match["round"]:
            side = Side(side.method, {**side.where, "round": match["round"]})
        values = list(final_by_seed(rows, side, column).values())
        if not values:
            return "no such run in the folder's metrics.csv"
        return None if _same(citation.quoted, values[0]) else f"the run gives {values[0]:.6g}"
    if match := _OVER_SEEDS.match(citation.source):
        finals = final_by_seed(rows, Side(_named(match["method"]), block.where), match["column"] or "accuracy")
        if match["seeds"]:
            finals = {seed: value for seed, value in finals.items() if seed in match["seeds"].split(",")}
        values = list(finals.values())
        if match["kind"] == "mean":
            if not values:
                return "no such runs in the folder's metrics.csv"
            mean = float(np.mean(values))
            return None if _same(citation.quoted, mean) else f"the runs give {mean:.6g} ({len(values)} seeds)"
        if len(values) < 2:
            return f"{len(values)} seed(s): no interval"
        mean, half = float(np.mean(values)), confidence_half_width(values)
        if _same_interval(citation.quoted, mean, half):
            return None
        return f"the runs give {mean:.4f} ± {half:.4f} ({len(values)} seeds)"
    if match := _PAIRED.match(citation.source):
        column = match["column"] or "accuracy"
        subject = final_by_seed(rows, Side(_named(match["method"]), block.where), column)
        reference = final_by_seed(rows, Side(_named(match["reference"]), block.where), column)
        seeds = _paired_seeds(subject, reference, match["seeds"])
        if len(seeds) < 2:
            return f"{len(seeds)} seed(s) run by both: no interval"
        differences = [100 * (subject[seed] - reference[seed]) for seed in seeds]
        mean, half = float(np.mean(differences)), confidence_half_width(differences)
        if len(citation.quoted.replace("±", " ").split()) != 2:
            return "a paired difference is quoted as 'D ± H'"
        if _same_interval(citation.quoted, mean, half):
            return None
        return f"the runs give {mean:+.4f} ± {half:.4f} points ({len(seeds)} seeds)"
    return (
        "not a form this checker reads (METHOD seed S [round R | rounds A-B] [COLUMN], METHOD mean|interval "
        "[over seeds 0,1] [COLUMN], METHOD - REFERENCE [over seeds 0,1] [COLUMN], METHOD - REFERENCE "
        "[over seeds 0,1] [COLUMN] verdict "
        "[matches MARGIN], METHOD [seed S] parameters, paper TABLE METHOD [column=value ...], default SETTING)"
    )


def _parameters(block: Block, match: re.Match[str], quoted: str) -> str | None:
    """A model's size (``METHOD [seed S] parameters``): run.json's ``model_parameters`` of each of the
    method's finished runs that the block's filter (and the seed) picks, one count for all."""
    from fedcond.tools.experiment import finished_runs, load_experiment

    if block.folder.suffix == ".csv":
        return "a count of parameters is read from a results folder's run.json, not from a CSV file"
    if not re.fullmatch(r"\d{1,3}(?:,\d{3})*|\d+", quoted):
        return "a count of parameters is quoted as a whole number (1,115,555)"
    counts: dict[str, int] = {}
    for _, info, named in finished_runs(load_experiment(block.folder), block.folder):
        picked = {**block.where, **({"seed": match["seed"]} if match["seed"] else {})}
        if str(named["method"]) == _named(match["method"]) and all(
            str(named.get(key)) == value for key, value in picked.items()
        ):
            counts[str(named["seed"])] = int(info["model_parameters"])
    if not counts:
        return "no such finished run in the folder's runs"
    if len(set(counts.values())) > 1:
        return "its runs differ: " + ", ".join(f"seed {seed} {count:,}" for seed, count in sorted(counts.items()))
    count = next(iter(counts.values()))
    return None if int(quoted.replace(",", "")) == count else f"the runs give {count:,}"


def _paper_value(block: Block, match: re.Match[str], quoted: str) -> str | None:
    """A number of the paper's (``paper TABLE METHOD [column=value ...]``): some row of its results
    (experiments/paper/results.csv) with that table and method, and the filters, gives it."""
    with (block.root / _PAPER_RESULTS).open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    filters = dict(pair.split("=", 1) for pair in match["filters"].split())
    chosen = [
        row for row in rows
        if row["table"] == match["table"] and row["method"] == match["method"]
        and all(row.get(key) == value for key, value in filters.items())
    ]  # fmt: skip
    if not chosen:
        return f"the paper's table {match['table']} has no {match['method']} row with {filters or 'no filter'}"
    if any(_same(quoted, float(row["value"])) for row in chosen):
        return None
    return f"the paper's rows give {', '.join(sorted({row['value'] for row in chosen}))}"


def _pattern(citation: Citation) -> re.Pattern[str]:
    """How ``citation``'s quoted value shows in its text: a verdict's words, a count as printed, a number
    (a signed difference by its magnitude: its sign is checked apart) with its ``± H`` where it has one."""
    if _VERDICT.match(citation.source):
        return re.compile(rf"(?<![\w-]){re.escape(citation.quoted)}(?![\w-])")
    if _PARAMETERS.match(citation.source):
        return re.compile(rf"(?<!\d)(?<!\d[,.]){re.escape(citation.quoted)}(?!\d|[,.]\d)")
    first, _, half = citation.quoted.partition("±")
    number = rf"(?<![\d.]){re.escape(first.strip().lstrip('+' + _MINUS))}(?!\d)"
    return re.compile(number + (rf"\s*±\s*{re.escape(half.strip())}(?!\d)" if half else ""))


def _sign_shown(text: str, match: re.Match[str]) -> int:
    """The sign the text gives the difference ``match`` found: a + or - right before it, else the
    direction word right after it (after "points"), else the nearest before it in its sentence, else
    + (an unsigned number with no word is positive)."""
    before = text[: match.start()]
    if before[-1:] and before[-1] in "+" + _MINUS and not before[-2:-1].isalnum():
        return 1 if before[-1] == "+" else -1
    after = re.match(r"\s*(?:points?\s+)?(\w+)", text[match.end() :])
    if after and after[1] in (*UNDER, *ABOVE):
        return -1 if after[1] in UNDER else 1
    sentence = re.split(r"\.\s", before)[-1]
    words = _DIRECTION.findall(sentence)
    if words:
        return -1 if words[-1] in UNDER else 1
    return 1


def placed(block: Block) -> list[str | None]:
    """For each citation of ``block``, why its text does not show it where it should (None: it does):
    each quoted value is looked for after the one cited before it, whole, and a difference with its sign."""
    said: list[str | None] = []
    position, start, previous = 0, 0, None
    for citation in block.citations:
        pattern = _pattern(citation)
        # Two lines quoting one value ("worst participant and worst newcomer at 0.000") may share its place.
        shared = previous is not None and previous.quoted == citation.quoted
        match = pattern.search(block.text, start if shared else position)
        if match is None:
            earlier = pattern.search(block.text)
            if earlier is None:
                said.append(_absent(block.text, citation))
                continue
            assert previous is not None  # the first citation is looked for from the text's start
            said.append(
                f"{citation.quoted} ({citation.source}) is out of order: the text shows it before "
                f"{previous.quoted} ({previous.source}), cited above it; cite in the order the text reads, "
                "or the text has swapped them"
            )
            position, start, previous = earlier.end(), earlier.start(), citation
            continue
        position, start, previous = match.end(), match.start(), citation
        said.append(_signed(block.text, match, citation))
    return said


def _absent(text: str, citation: Citation) -> str:
    """Why ``citation`` is nowhere in ``text``: an interval whose mean is there with another width says so."""
    mean, interval, _ = citation.quoted.partition("±")
    magnitude = re.escape(mean.strip().lstrip("+" + _MINUS))
    width = re.search(rf"(?<![\d.]){magnitude}\s*±\s*[\d.]+", text) if interval else None
    return f"{citation.quoted} ({citation.source}) is not in the text above it" + (
        f": the text shows {width[0]}, another width" if width else ""
    )


def _signed(text: str, match: re.Match[str], citation: Citation) -> str | None:
    """Why the difference ``citation`` quotes shows in ``text`` (at ``match``) with no sign or the other one."""
    number = re.fullmatch(r"\s*([+\u2212-]?\d+(?:\.\d+)?)\s*", citation.quoted.partition("±")[0])
    if not _PAIRED.match(citation.source) or _VERDICT.match(citation.source) or not number:
        return None  # not a difference, or not one as 'D ± H' (which ``measured`` says)
    value = float(number[1].replace("\u2212", "-"))
    if value == 0:
        return None
    if (_sign_shown(text, match) > 0) == (value > 0):
        return None
    return (
        f"{citation.quoted} ({citation.source}): the text reads {'+-'[value > 0]}{match[0]}, the other sign; "
        "sign it (-0.98, +0.98) or say which way (under, above)"
    )


def _paired_seeds(subject: Mapping[str, float], reference: Mapping[str, float], named: str | None) -> list[str]:
    """The seeds both sides ran, or those of them ``named`` ("0,1,2": a claim's declared seeds, when
    later ones ran post hoc); a named seed one side lacks is left out, so the count quoted shows it."""
    seeds = set(subject) & set(reference)
    if named is not None:
        seeds &= set(named.split(","))
    return sorted(seeds, key=int)


def _shown(path: Path, root: Path) -> str:
    """``path`` as a message names it: from the repository's root where it is inside it."""
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def problems(path: Path, root: Path) -> list[str]:
    """Every cited number of ``path`` that its runs do not give, or its text does not show, and every
    precise number of a citing block that no line cites: one line each, 'file:line: what'."""
    found = []
    every = list(blocks(path, root))
    cited: dict[int, set[str]] = {}  # by the first line of the text the citations follow
    for block in every:
        numbers = {number for citation in block.citations for number in re.findall(r"\d+\.\d+", citation.quoted)}
        cited.setdefault(block.line, set()).update(numbers)
    for block in every:
        for citation, shown in zip(block.citations, placed(block), strict=True):
            where = f"{_shown(path, root)}:{citation.line}"
            if shown:
                found.append(f"{where}: {shown}")
                continue
            wrong = measured(block, citation)
            if wrong:
                found.append(f"{where}: {citation.source}: {citation.quoted} is not what the runs say: {wrong}")
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.startswith(OUTSIDE):
            command = line[len(OUTSIDE) :].removesuffix("-->").split()
            script = (
                next((part for part in command[1:] if part.endswith(".py")), None)
                if command[:1] == ["python"]
                else None
            )
            if not command or (script is not None and not (root / script).is_file()):
                found.append(f"{_shown(path, root)}:{number}: an outside measurement names no command that exists")
    for line in sorted(cited):
        text = next(block.text for block in every if block.line == line)
        for number in precise_numbers(text):
            if number not in cited[line]:
                found.append(f"{_shown(path, root)}:{line}: {number} is in a citing text and not cited")
    return found


def uncited(path: Path, root: Path) -> list[tuple[int, list[str]]]:
    """The texts of ``path`` (blank-line separated; code blocks, comments and generated blocks
    aside) that hold numbers of three or more decimals and neither cite their runs nor say they were
    measured outside the committed results: (first line, those numbers) each."""
    lines = path.read_text().splitlines()
    found: list[tuple[int, list[str]]] = []
    fenced = generated = commented = False
    text: list[str] = []
    start = 0

    def close(following: str) -> None:
        numbers = precise_numbers("\n".join(text))
        if numbers and not following.startswith((OPENING, OUTSIDE)):
            found.append((start + 1, numbers))

    for index, line in enumerate([*lines, ""]):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if commented:
            commented = "-->" not in line
            continue
        if line.startswith("<!--") and "generated by" in line:
            generated = True
        if generated:
            generated = not line.startswith("<!-- end of the generated")
            continue
        if not line.strip() or line.startswith("<!--"):
            if text:
                close(line)
            text = []
            commented = line.startswith("<!--") and "-->" not in line
            continue
        if not text:
            start = index
        text.append(line)
    return found


#: The columns ``suggest`` looks in: a run's final values and their means, and accuracy and training
#: loss round by round.
SUGGESTED_COLUMNS = (
    "accuracy", "worst_accuracy", "p10_accuracy", "heldout_accuracy", "heldout_worst_accuracy",
    "heldout_adapted_accuracy", "validation_accuracy", "heldout_validation_accuracy", "train_loss", "loss",
)  # fmt: skip


def suggest(path: Path, line: int, folder: Path, where: dict[str, str]) -> list[str]:
    """For each precise number of the text around ``line`` of ``path``, the citation lines of
    ``folder``'s runs that give it at its printed precision (several where it is ambiguous; none
    where no run does): a start for citing an old text, to be read before it is pasted."""
    lines = path.read_text().splitlines()
    start = end = line - 1
    while start > 0 and lines[start - 1].strip():
        start -= 1
    while end < len(lines) and lines[end].strip():
        end += 1
    text = "\n".join(lines[start:end])
    rows = [row for row in metrics_rows(folder) if all(row.get(key) == value for key, value in where.items())]
    candidates: list[tuple[str, float]] = []
    methods = sorted({row["method"] for row in rows})
    for method in methods:
        for column in SUGGESTED_COLUMNS:
            finals = final_by_seed(rows, Side(method, {}), column)
            named = "" if column == "accuracy" else f" {column}"
            candidates += [(f"{method} seed {seed}{named}", value) for seed, value in finals.items()]
            if len(finals) > 1:
                candidates.append((f"{method} mean{named}", float(np.mean(list(finals.values())))))
        for row in rows:
            if row["method"] == method:
                for column in ("accuracy", "train_loss"):
                    named = "" if column == "accuracy" else f" {column}"
                    value = float(row[column]) if row.get(column) not in ("", None) else math.nan
                    candidates.append((f"{method} seed {row['seed']} round {row['round']}{named}", value))
    suggested = []
    for number in dict.fromkeys(precise_numbers(text)):
        matches = [source for source, value in candidates if _same(number, value)]
        finals_first = sorted(dict.fromkeys(matches), key=lambda source: (" round " in source, source))
        if not finals_first:
            suggested.append(f"# {number}: no run of {folder.name} gives it")
        else:
            suggested += [f"{source}: {number}" for source in finals_first[:3]]
            if len(finals_first) > 3:
                suggested.append(f"# {number}: {len(finals_first) - 3} more runs give it")
    return suggested


def main(arguments: list[str] | None = None) -> int:
    """``python -m tools.prose_numbers FILE:LINE FOLDER [key=value ...]``: suggested citations."""
    import argparse

    parser = argparse.ArgumentParser(description=suggest.__doc__)
    parser.add_argument("place", help="FILE:LINE of the text to cite")
    parser.add_argument("folder", help="the results folder its numbers come from")
    parser.add_argument("where", nargs="*", help="column=value pairs that pick the folder's rows")
    parsed = parser.parse_args(arguments)
    file, _, line = parsed.place.rpartition(":")
    where = dict(pair.split("=", 1) for pair in parsed.where)
    header = " ".join([OPENING + parsed.folder, *(["where", *parsed.where] if where else [])])
    print("\n".join([header, *suggest(Path(file), int(line), Path(parsed.folder), where), "-->"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

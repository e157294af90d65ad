"""Every command in README.md and docs/*.md runs as written, so a page cannot drift from the code.

What counts as a command: a line of a fenced code block (```), with its `\\` continuations joined, split by the
shell's rules (`shlex`), and cut at `&&`, `||`, `;` and `|` into segments. A segment is checked when, after any
leading `NAME=value` environment assignments, it is one of

- `python -m mlplat.train ARGS`, `torchrun [OPTIONS] -m mlplat.train ARGS` or `docker run [OPTIONS] mlplat:TAG
  ARGS` (the images' entry point is mlplat.train): ARGS are parsed by Hydra's override parser, `+experiment=`
  rewritten as train.py rewrites it, a `-m` sweep expanded into its points by Hydra's basic sweeper, and each point
  composed with Hydra's compose API (the hydra config included: `hydra/launcher=...` must resolve), its keys and
  value types checked (`mlplat.config.from_dict`: an unknown key fails), validated (`load_config`) and put
  through `mlplat.train.preflight` (the data, the tokenizer, the data size, the attention backend), without its
  two checks of the reader's own machine (its GPUs, its checkpoints); with `dry_run=true` the dry run then runs
  (in this process);
- `python -m mlplat.plan ARGS`: the planner runs in this process, must exit 0 and print its launch line (with
  `validate` or `compose`, below, it stops where the search would start: its keys checked, the model and cluster
  files read);
- `python -m mlplat.data.preprocess|checkpoint.export|perf.timeline ARGS`: ARGS are parsed by the module's own
  argparse parser (the module does not run);
- `python experiments/PATH.py ARGS`: the script exists and each `--flag` in ARGS appears in its source.

Any other `python -m mlplat.*` module fails the test until a rule for it is added here.

A page may mark a command with a shell comment at the end of its last line: `# ... test: WORDS`. In WORDS,
- `KEY=VALUE` tokens are appended to the command's arguments (after the command as written was parsed), e.g. a
  smaller budget for the planner;
- `validate`: stop after validation and preflight, before a dry run or a planner search too slow for this test
  (tests/perf/test_dry_run.py and tests/test_plan.py run those);
- `compose`: stop after composition and the key and type checks (a command that names files that do not exist
  here: `data.path=...`, `data.prefix=...`, `init_from=...`);
- `run` (argparse modules): run the module for real, in a temporary directory.

A page's commands also hold together in the order a reader runs them: a checkpoint one resumes or exports is
one an earlier command of the page saves. The pages hold no command in an indented (unfenced) code block, every
page under docs/ is linked from the README (at most 250 lines), links to sections (`page.md#anchor`) find their
heading, and the paths named in the pages (links, and `mlplat/...`, `tests/...`, `experiments/...`, `conf/...`,
`docs/...`, `docker/...` in backticks) exist.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SEPARATORS = {"&&", "||", ";", "|"}
ARGPARSE_MODULES = {"mlplat.data.preprocess", "mlplat.checkpoint.export", "mlplat.perf.timeline"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
HYDRA_FLAGS = {"-m", "--multirun"}


@dataclass
class Command:
    page: str
    line: int
    text: str
    argv: list[str]  # the segment, from the program on
    marker: list[str] = field(default_factory=list)  # the words after `test:`

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def level(self) -> str:
        words = [w for w in self.marker if "=" not in w]
        return words[0] if words else "full"

    @property
    def appended(self) -> list[str]:
        return [w for w in self.marker if "=" in w]


SHELL_FENCES = {"", "bash", "sh", "shell", "console"}


def _logical_lines(text: str):
    """(line number, joined line) of every line inside a shell fenced block (a heredoc's body left out); and the
    command lines of unfenced indented blocks."""
    fenced, indented, in_fence, shell, pending, start, heredoc = [], [], False, False, "", 0, None
    lines = text.splitlines()
    for n, raw in enumerate(lines, start=1):
        if raw.strip().startswith("```"):
            in_fence = not in_fence
            shell = raw.strip()[3:].strip() in SHELL_FENCES
            continue
        if not in_fence:
            if raw.startswith("    ") and re.match(r"\s+(python3? -m mlplat\.|python3? experiments/)", raw):
                indented.append((n, raw.strip()))
            continue
        if not shell:
            continue
        if heredoc is not None:
            heredoc = None if raw.strip() == heredoc else heredoc
            continue
        found = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", raw)
        if found:  # `python - <<'EOF'`: the body is another language
            heredoc = found.group(1)
            continue
        if not pending:
            start = n
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        fenced.append((start, pending + raw))
        pending = ""
    return fenced, indented


def _split_comment(line: str) -> tuple[str, str]:
    """(code, comment): the shell's comment starts at an unquoted `#` that begins a word."""
    quote, escaped = None, False
    for k, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k], line[k + 1:]
    return line, ""


def _segments(tokens: list[str]):
    seg: list[str] = []
    for t in tokens:
        if t in SEPARATORS:
            yield seg
            seg = []
        else:
            seg.append(t)
    yield seg


def _program(seg: list[str]) -> list[str] | None:
    """The segment from its program on, normalised to `python -m MODULE ...` / `python experiments/...`, or None."""
    while seg and ENV_ASSIGNMENT.match(seg[0]):
        seg = seg[1:]
    if len(seg) >= 2 and seg[0] in ("python", "python3"):
        if seg[1] == "-m" and len(seg) > 2 and seg[2].startswith("mlplat."):
            return ["python", "-m", *seg[2:]]
        if seg[1].startswith("experiments/"):
            return ["python", *seg[1:]]
    if seg and seg[0] == "torchrun" and "-m" in seg and seg[seg.index("-m") + 1:][:1] == ["mlplat.train"]:
        i = seg.index("-m")
        nproc = next((seg[k + 1] for k, t in enumerate(seg[:i]) if t in ("--nproc-per-node", "--nproc_per_node")),
                     None)
        return ["torchrun", f"--nproc-per-node={nproc}", "-m", *seg[i + 1:]]
    if seg[:2] == ["docker", "run"]:
        image = next((k for k, t in enumerate(seg) if t.startswith("mlplat:")), None)
        if image is not None:
            return ["python", "-m", "mlplat.train", *seg[image + 1:]]
    return None


def extract(page: Path) -> tuple[list[Command], list[tuple[int, str]]]:
    fenced, indented = _logical_lines(page.read_text())
    out = []
    for n, line in fenced:
        if line.lstrip().startswith("#"):
            continue
        code, comment = _split_comment(line)
        tokens = shlex.split(code)
        marker = comment.split("test:", 1)[1].split() if "test:" in comment else []
        for seg in _segments(tokens):
            argv = _program(seg)
            if argv is not None:
                out.append(Command(page.relative_to(REPO).as_posix(), n, line.strip(), argv, marker))
    return out, indented


COMMANDS = [c for page in PAGES for c in extract(page)[0]]


# -------------------------------------------------------------------------------------------- the checks

@pytest.fixture(scope="module")
def hydra_conf():
    from hydra import initialize_config_dir

    import mlplat.train  # noqa: F401  (registers the ${mlplat.*} resolvers of the launcher configs)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        yield


def _train_points(args: list[str]) -> list[list[str]]:
    """Each point's overrides: one, or the points of a `-m` sweep as Hydra's basic sweeper expands them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from mlplat.train import experiment_as_choice

    multirun = any(a in HYDRA_FLAGS for a in args)
    args = [a for k, a in enumerate(args) if a not in HYDRA_FLAGS and a != "--cfg" and args[k - 1:k] != ["--cfg"]]
    overrides = experiment_as_choice(args)
    flags = [a for a in overrides if a.startswith("-")]
    assert not flags, f"unsupported flags {flags}"
    parsed = OverridesParser.create().parse_overrides(overrides)  # a lexer or parse error fails here
    if not multirun:
        return [overrides]
    return [point for batch in BasicSweeper.split_arguments(parsed, None) for point in batch]


def check_train(cmd: Command, args: list[str], world_size: int | None, tmp_path: Path, monkeypatch) -> None:
    from hydra import compose
    from omegaconf import OmegaConf

    from mlplat import train
    from mlplat.config import from_dict

    for point in _train_points(args):
        raw = compose("config", point, return_hydra_config=True)
        if "launcher" in raw.hydra and raw.hydra.launcher is not None and len(raw.hydra.launcher):
            OmegaConf.to_container(raw.hydra.launcher, resolve=True)  # the resources follow the run config
        plain = {k: OmegaConf.to_container(raw[k], resolve=True) if OmegaConf.is_config(raw[k]) else raw[k]
                 for k in raw if k != "hydra"}
        from_dict(plain)  # unknown keys, value types
        if cmd.level == "compose":
            continue
        cfg = train.load_checked(raw, world_size=world_size)
        # What train.py checks next, except what belongs to the reader's machine: its GPUs and its checkpoints.
        monkeypatch.setattr(train, "check_machine_fits", lambda cfg: None)
        monkeypatch.setattr(train, "resolve_ckpt_path", lambda path, run_dir: path)
        monkeypatch.setattr(train, "resumed_cadence", lambda path, save_last=True: 0)  # read from the one resumed
        monkeypatch.setattr(train, "check_resumed_model", lambda model, path: None)  # against the one resumed
        monkeypatch.setattr(train, "check_resumed_optimizer", lambda name, path: None)
        monkeypatch.setattr(train, "check_resumed_step", lambda path, max_steps: None)
        train.preflight(cfg, tmp_path)
        if cmd.level == "validate" or not cfg.dry_run:
            continue
        from mlplat.perf.dry_run import run_dry

        choice = raw.hydra.runtime.choices.get("experiment")
        own = [o for o in point if not o.startswith(("hydra.", "hydra/"))]
        with contextlib.redirect_stdout(io.StringIO()) as out:
            run_dry(cfg, tmp_path, experiment=choice, overrides=own)
        assert "predicted" in out.getvalue(), out.getvalue()


class _Parsed(Exception):
    pass


def check_plan(cmd: Command, args: list[str], monkeypatch) -> None:
    """The planner in this process; with `validate`/`compose` it stops where the search would start (its keys
    checked, the model and cluster files read)."""
    import mlplat.plan

    if cmd.level in ("validate", "compose"):
        def stop(*a, **k):
            raise _Parsed()
        monkeypatch.setattr(mlplat.plan, "search", stop)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            code = mlplat.plan.main(args)
        except _Parsed:
            return
    assert code == 0, out.getvalue()
    assert "launch: python -m mlplat.train" in out.getvalue(), out.getvalue()


def check_argparse(cmd: Command, module: str, args: list[str], tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [module, *args])
    if cmd.level == "run":
        monkeypatch.chdir(tmp_path)
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=False)
            except SystemExit as e:
                assert e.code in (None, 0), f"{module} exited {e.code}"
        return
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **k):
        raise _Parsed(original(self, *a, **k))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(_Parsed):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=False)
        except SystemExit:  # argparse refused the arguments
            raise AssertionError(f"{module} refused {args}: {stderr.getvalue().strip()}") from None


def check_experiment(cmd: Command, script: str, args: list[str]) -> None:
    path = REPO / script
    assert path.is_file(), f"{script} does not exist"
    source = path.read_text()
    for flag in (a.split("=")[0] for a in args if a.startswith("--")):
        assert f'"{flag}"' in source or f"'{flag}'" in source, f"{script} has no {flag} option"


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.id for c in COMMANDS])
def test_command_runs_as_written(cmd: Command, hydra_conf, tmp_path, monkeypatch):
    argv = cmd.argv
    if argv[0] == "torchrun":
        nproc = argv[1].split("=", 1)[1]
        check_train(cmd, argv[4:] + cmd.appended, int(nproc) if nproc.isdigit() else None, tmp_path, monkeypatch)
        return
    if argv[1] != "-m":
        check_experiment(cmd, argv[1], argv[2:])
        return
    module, args = argv[2], argv[3:] + cmd.appended
    if module == "mlplat.train":
        check_train(cmd, args, None, tmp_path, monkeypatch)
    elif module == "mlplat.plan":
        check_plan(cmd, args, monkeypatch)
    elif module in ARGPARSE_MODULES:
        check_argparse(cmd, module, args, tmp_path, monkeypatch)
    else:
        pytest.fail(f"{cmd.id}: no rule for `python -m {module}`: add one to tests/test_docs.py")


def _checkpoint_named(word: str) -> tuple[str, int] | None:
    """(run directory, step) of a word naming `RUN/checkpoints/step-N` (as a value: `ckpt_path=...`, or alone)."""
    found = re.fullmatch(r"(?:[\w.]+=)?(.+)/checkpoints/step-(\d+)", word)
    return (found.group(1), int(found.group(2))) if found else None


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_a_checkpoint_a_command_names_is_one_an_earlier_command_saves(page: Path, hydra_conf):
    """A page's commands, in order, as a reader runs them: each `RUN/checkpoints/step-N` a command resumes or exports
    was saved by an earlier training command of the page in RUN (every checkpoint.every_steps steps from where it
    started, and at trainer.max_steps; a resume without checkpoint.every_steps keeps the cadence it resumed)."""
    from hydra import compose

    from mlplat.train import experiment_as_choice

    saved: dict[str, set[int]] = {}
    cadence: dict[str, int] = {}
    for cmd in extract(page)[0]:
        for run, step in filter(None, map(_checkpoint_named, cmd.argv)):
            assert step in saved.get(run, set()), f"{cmd.id}: {run}/checkpoints/step-{step} was not saved before " \
                                                  f"(saved: {sorted(saved.get(run, ()))})"
        if cmd.argv[:3] != ["python", "-m", "mlplat.train"] or any(a in HYDRA_FLAGS for a in cmd.argv[3:]):
            continue
        args = [a for a in cmd.argv[3:] + cmd.appended if not a.startswith("hydra")]
        run = next((a.split("=", 1)[1] for a in cmd.argv if a.startswith("hydra.run.dir=")), None)
        if run is None:
            continue
        cfg = compose("config", experiment_as_choice(args))
        start, every = 0, cfg.checkpoint.every_steps
        if cfg.ckpt_path is not None:
            resumed = max(saved.get(run, {0})) if cfg.ckpt_path == "last" else _checkpoint_named(cfg.ckpt_path)[1]
            start, every = resumed, every if every is not None else cadence.get(run, 0)
        cadence[run] = every or 0
        if every:
            saved.setdefault(run, set()).update({*range(start + every, cfg.trainer.max_steps + 1, every),
                                                 cfg.trainer.max_steps})


# ------------------------------------------------------------------------------------------- the pages

def test_the_pages_hold_their_commands_in_fenced_blocks():
    commands = {c.page for c in COMMANDS}
    assert "README.md" in commands and len(COMMANDS) >= 30
    for page in PAGES:
        indented = extract(page)[1]
        assert not indented, f"{page.name}: commands outside a fenced block (not tested): {indented}"


def test_readme_is_short_and_links_every_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"


PATH_IN_BACKTICKS = re.compile(r"`((?:mlplat|tests|experiments|conf|docs|docker)/[^`\s]*)`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_named_paths_exist(page: Path):
    text = page.read_text()
    named = [m.split("::")[0] for m in PATH_IN_BACKTICKS.findall(text)]
    named += [m for m in LINK.findall(text) if "://" not in m]
    missing = []
    for name in named:
        if any(ch in name for ch in "<>*{}…$") or "DIR" in name:
            continue  # a placeholder
        base = page.parent if not name.startswith(("mlplat/", "tests/", "experiments/", "conf/", "docker/")) \
            else REPO
        if name.startswith("docs/"):
            base = REPO
        target = (base / name.rstrip(":,.;")).resolve()
        if not target.exists():
            missing.append(name)
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


def test_the_step_map_names_files_that_exist():
    """The README's "How a step flows" map names files relative to the repository, mlplat/ or mlplat/parallel/."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("## How a step flows", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    names = re.findall(r"[\w/]+\.py", block)
    assert len(names) >= 10
    roots = (REPO, REPO / "mlplat", REPO / "mlplat" / "parallel")
    missing = [n for n in names if not any((root / n).is_file() for root in roots)]
    assert not missing, f"README.md's step map names files that do not exist: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_links_to_sections_exist(page: Path):
    missing = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*\.md)?#([^)\s]+)\)", page.read_text()):
        doc = (page.parent / target).resolve() if target else page
        headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", doc.read_text(), flags=re.M)}
        if anchor not in headings:
            missing.append(f"{target}#{anchor}")
    assert not missing, f"{page.name} links to sections that do not exist: {missing}"


def test_a_drifted_command_fails(hydra_conf, tmp_path, monkeypatch):
    """The checks above refuse what they must: an unknown key, Hydra's lexer error on `~`, an unquoted comma
    list, an unknown planner key and an unknown flag of an argparse module."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from mlplat.config import ConfigError

    def cmd(line: str) -> Command:
        return Command("x", 1, line, _program(shlex.split(line)), [])

    for line, error in (("python -m mlplat.train +foo=1", ConfigError),
                        ("python -m mlplat.train model.bogus=3", (HydraException, OmegaConfBaseException)),
                        ("python -m mlplat.train data.path=~/books/", HydraException),
                        ("python -m mlplat.train data=indexed data.split=969,30,1", HydraException),
                        ("python -m mlplat.train parallel.tp=3", ConfigError)):
        with pytest.raises(error):
            c = cmd(line)
            check_train(c, c.argv[3:], None, tmp_path, monkeypatch)
    with pytest.raises(SystemExit):
        from mlplat.plan import main

        main(["model=tiny", "gpuz=8"])
    c = cmd("python -m mlplat.perf.timeline --bogus 1")
    with pytest.raises(AssertionError, match="refused"):
        check_argparse(c, "mlplat.perf.timeline", ["--bogus", "1"], tmp_path, monkeypatch)

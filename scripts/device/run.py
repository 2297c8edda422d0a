#!/usr/bin/env python3
"""Run named chains of steps on the GPU machine (chains.toml beside this file), detached, and poll them.

    scripts/device/run.py list                       the chains and their steps
    scripts/device/run.py start CHAIN... [--dry-run]  copy the repository to $CHAIN_DIR/repo and run the chains
                                                     there one after another, detached (setsid): it outlives
                                                     the device call that started it
    scripts/device/run.py poll                       each step's state and the tail of its log, then the table;
                                                     with $OUT set, the logs and JSON packed into $OUT/chain.tar.gz
    scripts/device/run.py run CHAIN... [--dry-run]    the same in the foreground, in this tree (a short chain)
    scripts/device/run.py stop                       end the running chain and its steps

--dry-run prints each step's command, environment and limits, and runs nothing.
Environment: SKIP="STEP ..." leaves steps out (a step's name, or CHAIN.STEP); CHAIN_DIR (default /tmp/chain);
TAIL (log lines poll shows, default 12); and the knobs chains.toml's commands read (${NAME:-default}), which
override a chain's own `env`.

Every step runs as `bash -c` with `set -eo pipefail` from the repository, the chains.toml preamble's functions
defined, python3 from the PATH, CXX=/usr/bin/g++ (the image's default g++ carries its own libstdc++, and an
artifact compiled with it segfaults when loaded), PYTHONPATH = the repository, then the server's wheels, and
OUT = the step's own folder. The wheels: every .whl/*.whl but typing_extensions (the image's anyio needs its
newer one, and an older copy first on the path breaks the server), installed once into /tmp/site. A step with
`creates` is skipped while that file exists (exports: delete the file to export again); when the file is still
missing after it ran, the rest of its chain is not run. Steps in a nested list run side by side.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHAINS_FILE = Path(__file__).resolve().with_name("chains.toml")
CHAIN_DIR = Path(os.environ.get("CHAIN_DIR", "/tmp/chain"))
SITE = Path("/tmp/site")
COMPILER = "/usr/bin/g++"
KILL_GRACE_S = 10
NOT_COPIED = (".git", "__pycache__", "artifacts", "*.pt2", ".pytest_cache")


@dataclass(frozen=True)
class Step:
    name: str
    run: str  # bash, after the preamble
    about: str = ""
    creates: str | None = None  # a path (bash words expanded): skip the step while it exists
    timeout: int = 600  # seconds, then its process group is ended
    needs: tuple[str, ...] = ()  # Python modules it imports (e.g. from carried wheels)


@dataclass(frozen=True)
class Planned:
    """One step of one chain, with the chain's environment."""

    chain: str
    step: Step
    env: dict[str, str]

    @property
    def id(self) -> str:
        return f"{self.chain}.{self.step.name}"


@dataclass
class Plan:
    stages: list[list[Planned]] = field(default_factory=list)  # in order; the steps of a stage side by side

    @property
    def steps(self) -> list[Planned]:
        return [p for stage in self.stages for p in stage]


def load(path: Path = CHAINS_FILE) -> tuple[str, dict[str, Step], dict[str, dict]]:
    """(preamble, steps by name, chains by name) from chains.toml; a chain naming an unknown step fails here."""
    doc = tomllib.loads(path.read_text())
    steps = {name: Step(name, raw["run"], raw.get("about", ""), raw.get("creates"), int(raw.get("timeout", 600)),
                        tuple(raw.get("needs", ()))) for name, raw in doc["steps"].items()}
    for name, chain in doc["chains"].items():
        for entry in chain["steps"]:
            for step in entry if isinstance(entry, list) else [entry]:
                if step not in steps:
                    raise SystemExit(f"chains.toml: chain {name} names an unknown step {step!r}")
    return doc.get("preamble", ""), steps, doc["chains"]


def plan(names: list[str], steps: dict[str, Step], chains: dict[str, dict]) -> Plan:
    unknown = [n for n in names if n not in chains]
    if unknown or not names:
        raise SystemExit(f"name chains to run ({', '.join(chains)}); unknown: {', '.join(unknown) or '-'}")
    result = Plan()
    for name in names:
        chain = chains[name]
        # The caller's environment wins over the chain's defaults.
        env = {key: os.environ.get(key, str(value)) for key, value in chain.get("env", {}).items()}
        for entry in chain["steps"]:
            group = entry if isinstance(entry, list) else [entry]
            result.stages.append([Planned(name, steps[step], env) for step in group])
    return result


# ------------------------------------------------------------------------------------------------ running


def step_env(planned: Planned, repo: Path, out: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(planned.env)
    site = f":{SITE}" if SITE.is_dir() else ""
    env.update(CXX=COMPILER, PYTHONPATH=f"{repo}{site}", PYTHONUNBUFFERED="1", OUT=str(out))
    return env


def script(preamble: str, step: Step) -> str:
    return f"set -eo pipefail\n{preamble}\n{step.run}"


def expand(words: str, env: dict[str, str]) -> str:
    """`words` as bash expands them in `env` (a path like "$ART")."""
    return subprocess.run(["bash", "-c", f'printf %s "{words}"'], env=env, capture_output=True, text=True,
                          check=True).stdout


def install_wheels(repo: Path) -> None:
    wheels = sorted(p for p in (repo / ".whl").glob("*.whl") if not p.name.startswith("typing_extensions"))
    if not wheels or SITE.is_dir():
        print(f"wheels: {'none carried in .whl/' if not wheels else f'{SITE} already holds them'}", flush=True)
        return
    print(f"wheels: installing {len(wheels)} from .whl/ into {SITE}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(SITE), *map(str, wheels)], check=True)


class State:
    """Each step's state and log under CHAIN_DIR: ID.state (one line), ID.log, and its folder ID/ ($OUT)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def set(self, planned: Planned, text: str) -> None:
        (self.folder / f"{planned.id}.state").write_text(text + "\n")

    def get(self, planned_id: str) -> str:
        path = self.folder / f"{planned_id}.state"
        return path.read_text().strip() if path.exists() else "waiting"

    def log(self, planned_id: str) -> Path:
        return self.folder / f"{planned_id}.log"

    def out(self, planned_id: str) -> Path:
        return self.folder / planned_id


class Stopped(Exception):
    """SIGTERM reached the driver (`run.py stop`)."""


def _stop(signum, frame) -> None:
    raise Stopped


def execute(plan_: Plan, preamble: str, repo: Path, folder: Path) -> int:
    """Run every stage in order (its steps side by side); the table at each chain's end. Non-zero if one failed."""
    signal.signal(signal.SIGTERM, _stop)
    (folder / "driver.pid").write_text(str(os.getpid()))
    state = State(folder)
    (folder / "plan.json").write_text(json.dumps([[p.id for p in stage] for stage in plan_.stages]))
    for planned in plan_.steps:
        state.set(planned, "waiting")
    install_wheels(repo)
    skip = set(os.environ.get("SKIP", "").split())
    broken: dict[str, str] = {}  # chain -> why the rest of it does not run
    failed = False
    last_of_chain = {p.chain: p.id for p in plan_.steps}
    for stage in plan_.stages:
        running = []
        for planned in stage:
            if planned.chain in broken:
                state.set(planned, f"not run: {broken[planned.chain]}")
            elif planned.step.name in skip or planned.id in skip:
                state.set(planned, "skipped (SKIP)")
            else:
                started = start_step(planned, preamble, repo, state)
                if started is not None:
                    running.append(started)
        failed |= wait_all(running, state, broken)
        for planned in stage:
            if last_of_chain[planned.chain] == planned.id:
                ids = [p.id for p in plan_.steps if p.chain == planned.chain]
                print(f"\n== chain {planned.chain} done\n{table(ids, state)}", flush=True)
    (folder / "finished").write_text(time.strftime("%H:%M:%S") + "\n")
    return 1 if failed else 0


@dataclass
class Running:
    planned: Planned
    process: subprocess.Popen
    started: float
    creates: str | None


def start_step(planned: Planned, preamble: str, repo: Path, state: State) -> Running | None:
    out = state.out(planned.id)
    out.mkdir(parents=True, exist_ok=True)
    env = step_env(planned, repo, out)
    creates = expand(planned.step.creates, env) if planned.step.creates else None
    if creates and Path(creates).exists():
        state.set(planned, f"reused {creates}")
        return None
    if planned.step.needs:
        check = subprocess.run(["python3", "-c", f"import {', '.join(planned.step.needs)}"], env=env,
                               capture_output=True, text=True)
        if check.returncode:
            why = (check.stderr.strip().splitlines() or ["no message"])[-1]
            state.set(planned, f"not run: needs {', '.join(planned.step.needs)} (carry their wheels in .whl/): {why}")
            return None
    state.set(planned, f"running since {time.strftime('%H:%M:%S')}")
    log = open(state.log(planned.id), "w")
    process = subprocess.Popen(["bash", "-c", script(preamble, planned.step)], cwd=repo, env=env, stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    return Running(planned, process, time.monotonic(), creates)


def wait_all(running: list[Running], state: State, broken: dict[str, str]) -> bool:
    """Until every step of a stage has ended (each within its timeout); True if one failed."""
    failed = False
    try:
        failed = _wait(running, state, broken)
    except Stopped:
        for run in running:
            end_group(run.process)
            state.set(run.planned, f"stopped (run.py stop) after {time.monotonic() - run.started:.0f} s")
        raise SystemExit("stopped")
    return failed


def _wait(running: list[Running], state: State, broken: dict[str, str]) -> bool:
    failed = False
    while running:
        time.sleep(1)
        for run in list(running):
            seconds = time.monotonic() - run.started
            code = run.process.poll()
            if code is None and seconds > run.planned.step.timeout:
                end_group(run.process)
                code, text = run.process.returncode, f"timed out after {seconds:.0f} s"
            elif code is None:
                continue
            else:
                text = f"exit {code} after {seconds:.0f} s"
            running.remove(run)
            failed |= code != 0
            if run.creates and not Path(run.creates).exists():
                broken[run.planned.chain] = f"{run.planned.step.name} did not write {run.creates}"
                text += f"; {run.creates} missing: the rest of the chain does not run"
            state.set(run.planned, text)
    return failed


def end_group(process: subprocess.Popen) -> None:
    """SIGTERM to the step's process group (it started its own session), SIGKILL after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(KILL_GRACE_S)
            break
        except subprocess.TimeoutExpired:
            continue
    process.wait()


# ------------------------------------------------------------------------------------------------ reporting


def table(ids: list[str], state: State) -> str:
    """A markdown table: each step's state and, from its JSON (or the last line of its log), its result."""
    lines = ["| step | state | result |", "|---|---|---|"]
    for planned_id in ids:
        result = headline(state.out(planned_id), state.log(planned_id)).replace("|", "/")
        lines.append(f"| {planned_id} | {state.get(planned_id)} | {result} |")
    return "\n".join(lines)


def headline(out: Path, log: Path) -> str:
    """What a step measured, in a line: its JSON documents' main numbers, else its log's last line."""
    parts = []
    for path in sorted(out.glob("*.json")) if out.is_dir() else []:
        try:
            found = summarize(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError, IndexError, ZeroDivisionError):
            found = None
        if found:
            parts.append(f"{path.stem}: {found}")
    if parts:
        return "; ".join(parts)
    if log.exists():
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1][:160] if lines else ""
    return ""


def summarize(doc: dict) -> str | None:
    """The main numbers of a `pt2serve bench --json` document (or soak.py's), by its mode."""
    ms = lambda seconds: "-" if seconds is None else f"{seconds * 1e3:.3g}"  # noqa: E731
    mode = doc.get("mode")
    if mode == "sweep":
        return ", ".join(f"T={r['tokens']}" + (f" ctx {r['context']}" if "context" in r else "")
                         + f" {ms(r['interval_seconds'])} ms"
                         + ("" if r["fraction_of_limit"] is None else f" {r['fraction_of_limit']:.0%}")
                         for r in doc["rows"][:8])
    if mode == "requests" and "rates" in doc:
        return ", ".join(f"{r['offered_rate']:g} req/s: {r['summary']['output_tokens_per_second']:,.0f} tok/s"
                         for r in doc["rates"])
    if mode == "requests":
        s = doc["summary"]
        return (f"{s['output_tokens_per_second']:,.0f} tok/s, TTFT p50 {ms(s['ttft_seconds']['p50'])} ms, "
                f"TPOT p50 {ms(s['tpot_seconds']['p50'])} ms" + (f", {s['failed']} failed" if s["failed"] else ""))
    if mode == "quality":
        r = doc["result"]
        return f"top-1 {r['top1_agreement']:.2%}, mean KL {r['mean_kl']:.2e}"
    if mode == "profile":
        return ", ".join(f"T={r['tokens']} {r['ms_per_step']:.3g} ms, {r['kernels_per_step']} kernels"
                         for r in doc["rows"])
    if mode == "matmuls":
        return ", ".join(f"M={r['tokens']} {doc['floor_ms'] / r['chosen_ms']:.0%} of floor" for r in doc["rows"])
    if mode == "startup":
        return "launch to 200: " + ", ".join("-" if r["ready_seconds"] is None else f"{r['ready_seconds']:.1f} s"
                                             for r in doc["runs"])
    if "passed" in doc:  # scripts/soak.py
        return f"{'passed' if doc['passed'] else 'FAILED'}, {doc['requests']:,} requests"
    return None


def poll(folder: Path) -> None:
    state = State(folder)
    plan_path = folder / "plan.json"
    if not plan_path.exists():
        raise SystemExit(f"no chain has run here ({plan_path} is missing)")
    ids = [i for stage in json.loads(plan_path.read_text()) for i in stage]
    tail = int(os.environ.get("TAIL", "12"))
    for planned_id in ids:
        text = state.get(planned_id)
        print(f"== {planned_id}: {text}")
        if text.startswith(("running", "exit", "timed out")) and state.log(planned_id).exists():
            print("\n".join(state.log(planned_id).read_text(errors="replace").splitlines()[-tail:]))
    finished = folder / "finished"
    if finished.exists():
        print(f"\nchain finished at {finished.read_text().strip()}")
    else:
        print("\nchain running" if _driver_alive(folder) else "\nchain stopped before its end")
    print(table(ids, state))
    out = os.environ.get("OUT")
    if out:  # one file: at most 8 come back from a device call
        with tarfile.open(Path(out) / "chain.tar.gz", "w:gz") as tar:
            for path in sorted(folder.iterdir()):
                if path.name != "repo":
                    tar.add(path, arcname=f"chain/{path.name}")
        print(f"packed {folder} (without repo/) into {out}/chain.tar.gz")


def _driver_alive(folder: Path) -> bool:
    pid_file = folder / "driver.pid"
    if not pid_file.exists():
        return False
    try:
        os.kill(int(pid_file.read_text()), 0)
    except (ProcessLookupError, ValueError):
        return False
    return True


def fresh_chain_dir() -> None:
    """An empty CHAIN_DIR, unless a chain is running there."""
    if _driver_alive(CHAIN_DIR):
        raise SystemExit(f"a chain is running (pid {(CHAIN_DIR / 'driver.pid').read_text().strip()}): poll it, "
                         "or end it with `scripts/device/run.py stop`")
    shutil.rmtree(CHAIN_DIR, ignore_errors=True)
    CHAIN_DIR.mkdir(parents=True)


def dry_run(plan_: Plan, preamble: str) -> None:
    print(f"setup: wheels from .whl/ (not typing_extensions) into {SITE} once; CXX={COMPILER}; "
          f"PYTHONPATH=<repo>:{SITE}; OUT=$CHAIN_DIR/<step>; bash -c 'set -eo pipefail; <preamble>; <step>'")
    skip = set(os.environ.get("SKIP", "").split())
    for number, stage in enumerate(plan_.stages, 1):
        for planned in stage:
            step = planned.step
            side = " (side by side with the rest of its stage)" if len(stage) > 1 else ""
            skipped = " SKIPPED (SKIP)" if step.name in skip or planned.id in skip else ""
            print(f"\n--- stage {number}: {planned.id}{side}{skipped}: {step.about}")
            print(f"    env: {' '.join(f'{k}={v}' for k, v in planned.env.items()) or '-'}; timeout {step.timeout} s"
                  + (f"; skipped while {step.creates} exists" if step.creates else "")
                  + (f"; needs {', '.join(step.needs)}" if step.needs else ""))
            print("\n".join("    " + line for line in step.run.strip().splitlines()))


def list_chains(steps: dict[str, Step], chains: dict[str, dict]) -> None:
    for name, chain in chains.items():
        order = " -> ".join(" + ".join(e) if isinstance(e, list) else e for e in chain["steps"])
        print(f"{name}: {chain.get('about', '')}\n    {order}")


def main(argv: list[str]) -> int:
    preamble, steps, chains = load()
    verb, args = (argv[0], argv[1:]) if argv else ("list", [])
    is_dry = "--dry-run" in args
    names = [a for a in args if a != "--dry-run"]
    if verb == "list":
        list_chains(steps, chains)
    elif verb in ("start", "run") and is_dry:
        dry_run(plan(names, steps, chains), preamble)
    elif verb == "start":
        plan(names, steps, chains)  # unknown names fail before anything is copied
        fresh_chain_dir()
        repo = CHAIN_DIR / "repo"  # a copy: later device calls may rewrite the working tree under a live chain
        shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(*NOT_COPIED), symlinks=True)
        with open(CHAIN_DIR / "driver.log", "w") as log:
            driver = subprocess.Popen([sys.executable, str(repo / "scripts/device/run.py"), "_execute", *names],
                                      cwd=repo, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        (CHAIN_DIR / "driver.pid").write_text(str(driver.pid))  # the driver writes it too, once it runs
        print(f"started {' '.join(names)} (pid {driver.pid}) in {repo}; poll with scripts/device/run.py poll")
    elif verb == "_execute":  # the detached driver, in its copy of the repository
        return execute(plan(names, steps, chains), preamble, ROOT, CHAIN_DIR)
    elif verb == "run":
        fresh_chain_dir()
        code = execute(plan(names, steps, chains), preamble, ROOT, CHAIN_DIR)
        poll(CHAIN_DIR)
        return code
    elif verb == "poll":
        poll(CHAIN_DIR)
    elif verb == "stop":
        if not _driver_alive(CHAIN_DIR):
            raise SystemExit("no chain is running")
        pid = int((CHAIN_DIR / "driver.pid").read_text())
        os.kill(pid, signal.SIGTERM)  # the driver ends each running step's process group, then itself
        print(f"sent SIGTERM to the driver (pid {pid}); its running steps end with it")
    else:
        raise SystemExit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

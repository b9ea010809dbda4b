"""A seeded campaign of hostile inputs: every command and file kind, in process (click's CliRunner) and through the
Python API. Bad input must exit 2 with a message (never a traceback, never 0 or 1), valid input 0 or 1, and nothing
may hang.

    python benchmarks/fuzz_campaign.py [--seed 41] [--cli 1000] [--api 200]

Writes benchmarks/results/fuzz_campaign.md: the counts, and every case that broke a rule (command line, exit code,
the exception's last line).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import random
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
HANG_S = 30

# (value, valid) pools per kind of argument
BIG = "9" * 400
INTS = [("1", True), ("4", True), ("0", False), ("-1", False), (BIG, False), ("2.5", False), ("abc", False),
        ("", False), ("nan", False), ("1e3", False), ("99999999", False)]
SIZES = [("12GiB", True), ("24GB", True), ("16000MiB", True), ("0", False), ("0.5b", False), ("-1GiB", False),
         ("abc", False), (BIG, False), ("1e3", False), ("", False), ("12 parsecs", False)]
FRACTIONS = [("5%", True), ("0.1", True), ("0", True), ("nan", False), ("-5%", False), ("150%", False),
             ("abc", False), ("", False), ("inf", False)]
MODELS = [("gpt2", True), ("meta-llama/Llama-2-7b-hf", True), ("google-t5/t5-small", True),
          ("mistralai/Mistral-7B-Instruct-v0.2", False), ("llama-7", False), ("", False), ("../../etc", False),
          ("no/such-model", False)]
GPUS = [("t4", True), ("RTX 3060", True), ("A100 80GB", True), ("voodoo5", False), ("", False), ("3060 Ti Super", False)]
CHOICES = {"--technique": ["full", "lora", "qlora", "freeze"], "--precision": ["fp32", "bf16", "bf16-mixed", "fp16-mixed"],
           "--optimizer": ["adamw", "adamw-8bit", "adafactor", "sgd"], "--attn-impl": ["eager", "sdpa"]}


def _files(tmp: Path) -> dict[str, list[tuple[str, bool]]]:
    """Config, sweep, plan and CSV files, each valid or not (by construction)."""
    base = json.loads((ROOT / "memplan/data/models/configs/openai-community__gpt2.json").read_text())
    configs = []
    for i, override in enumerate([{}, {"n_layer": "2"}, {"n_layer": 0}, {"n_layer": 100000}, {"n_embd": 0},
                                  {"n_head": 0}, {"vocab_size": -5}, {"torch_dtype": "float128"},
                                  {"model_type": ["gpt2"]}, {"n_embd": 770}, {"tie_word_embeddings": "yes"},
                                  {"n_layer": 2}]):
        p = tmp / f"config{i}" / "config.json"
        p.parent.mkdir()
        p.write_text(json.dumps({**base, **override}))
        configs.append((str(p), override in ({}, {"n_layer": 2})))
    for name, data in (("latin1.json", '{"model_type": "gpt2", "n": "é"}'.encode("latin-1")),
                       ("utf16.json", json.dumps(base).encode("utf-16")), ("binary.json", bytes(range(256))),
                       ("deep.json", b'{"model_type": "gpt2", "x": ' + b"[" * 50000 + b"]" * 50000 + b"}"),
                       ("list.json", b"[1, 2]"), ("empty.json", b"")):
        (tmp / name).write_bytes(data)
        configs.append((str(tmp / name), False))
    sweeps = []
    for i, (text, ok) in enumerate([("models: [gpt2]\nmatrix: {batch_size: [1]}\n", True), ("models: gpt2x\n", False),
                                    ("models: [gpt2]\nemulate: RTX 3060\n", False), ("models: [gpt2]\ninclude: 5\n", False),
                                    ("models: [gpt2]\nsteps: '3'\n", False), ("- a\n", False), (": :", False),
                                    ("models: [gpt2]\nmatrix: {batch_size: " + str(list(range(1, 400))) +
                                     ", lora_r: " + str(list(range(1, 400))) + "}\n", False)]):
        p = tmp / f"sweep{i}.yaml"
        p.write_text(text)
        sweeps.append((str(p), ok))
    csvs = []
    for i, (data, ok) in enumerate([(b"model,status,measured_allocated_bytes\ngpt2,ok,nan\n", True),
                                    (b"model\n\xff\xfe\x00", False), (b"a,b,c\n1,2,3\n", False),
                                    (b"", True)]):
        p = tmp / f"rows{i}.csv"
        p.write_bytes(data)
        csvs.append((str(p), ok))
    return {"config": configs, "sweep": sweeps, "csv": csvs}


def _plan_files(tmp: Path, runner, main) -> list[tuple[str, bool]]:
    import yaml
    good = tmp / "plan.yaml"
    runner.invoke(main, ["plan", "gpt2", "--gpu", "RTX 3060", "--technique", "lora", "-o", str(good)])
    doc = yaml.safe_load(good.read_text())
    out = [(str(good), True)]
    for i, edit in enumerate([lambda d: d.update(memplan="hello"), lambda d: d["memplan"].update(setup=["x"]),
                              lambda d: d.update(model=7), lambda d: d["model"].pop("dtype"),
                              lambda d: d["memplan"].update(gpu_memory_gib="abc")]):
        d = copy.deepcopy(doc)
        edit(d)
        p = tmp / f"plan{i}.yaml"
        p.write_text(yaml.safe_dump(d))
        out.append((str(p), False))
    return out


def _pick(rng, pool):
    return rng.choice(pool)


def _setup_flags(rng) -> tuple[list[str], bool]:
    args, ok = [], True
    for _ in range(rng.randint(0, 3)):
        kind = rng.random()
        if kind < 0.4:
            flag = rng.choice(list(CHOICES))
            if flag in args:
                continue
            args += [flag, rng.choice(CHOICES[flag] + ["bogus"])]
            ok &= args[-1] != "bogus"
        else:
            flag = rng.choice(["--batch-size", "--seq-len", "--grad-accum", "--lora-r", "--num-gpus"])
            if flag in args:  # click keeps the last of a repeated option: the case's label would be wrong
                continue
            value, valid = _pick(rng, INTS)
            args += [flag, value]
            ok &= valid
    return args, ok


def _cli_case(rng, files) -> tuple[list[str], bool | None]:
    """(arguments, whether they are valid; None: valid-looking, any of 0/1/2 allowed)."""
    cmd = rng.choice(["estimate", "fit", "plan", "doctor", "plot", "check", "validate", "trace", "models", "gpus"])
    flags, ok = _setup_flags(rng)
    if cmd in ("models", "gpus"):
        return [cmd] + (["--json"] if rng.random() < 0.5 else ["--bogus"]), None
    if cmd == "check":
        path, ok1 = _pick(rng, files["csv"])
        tol, ok2 = _pick(rng, FRACTIONS)
        return ["check", path, "--tolerance", tol, "--report", str(Path(path).with_suffix(".md"))], None if ok1 and ok2 \
            else False
    if cmd == "validate":
        if rng.random() < 0.5:
            path, ok1 = _pick(rng, files["sweep"])
            out = rng.choice(["/proc/memplan/o.csv", str(Path(path).with_suffix(".csv"))])
            return ["validate", "--sweep", path, "--device", "cpu", "--out", out], False if not ok1 or out.startswith("/proc") \
                else None
        return ["validate", rng.choice(["gpt2", "llama-7"]), "--device", rng.choice(["cuda", "tpu"])] + flags, False
    model, ok_model = (_pick(rng, files["config"]) if rng.random() < 0.3 else _pick(rng, MODELS))
    args = [cmd, model] if model else [cmd]
    ok_model = ok_model and bool(model)  # the options' validity stays in ok
    if cmd in ("fit", "plan", "doctor", "plot"):
        if rng.random() < 0.5:
            gpu, ok_gpu = _pick(rng, GPUS)
            args += ["--gpu", gpu]
        else:
            size, ok_gpu = _pick(rng, SIZES)
            args += ["--memory", size]
        ok = ok and ok_gpu
        if rng.random() < 0.3:
            head, ok_h = _pick(rng, FRACTIONS)
            args += ["--headroom", head]
            ok = ok and ok_h
    if cmd == "plan" and rng.random() < 0.3:
        host, ok_host = _pick(rng, SIZES)
        args += ["--host-memory", host]
        ok = ok and ok_host
    if cmd == "doctor" and rng.random() < 0.4:
        plan, ok_plan = _pick(rng, files["plan"])
        args = ["doctor", "--from", plan] + args[2:]  # the plan names the model
        ok_model = ok_plan
    if cmd == "plot":
        args += ["--x", rng.choice(["batch_size", "seq_len", "lora_r"]), "-o", str(files["tmp"] / "p.png")]
        if rng.random() < 0.4:
            values, ok_v = rng.choice([("1,2,4", True), ("", False), ("1000000000000", False), ("a,b", False)])
            args += ["--values", values]
            ok = ok and ok_v
    if cmd == "trace":
        args += ["--layers", "2", "--batch-size", "1", "--seq-len", "32"]
        flags = [f for f in flags if f not in ("--batch-size", "--seq-len")]
    return args + flags, None if ok and ok_model else False


def _api_cases(rng, files) -> list[tuple[str, object, bool]]:
    """(label, call, valid) for the Python API."""
    import memplan
    from memplan import Setup
    cases = []
    for _ in range(200):
        kind = rng.choice(["estimate", "setup", "fit", "plan", "check", "load_spec", "find_gpu", "diagnose"])
        if kind == "estimate":
            field, (value, ok) = rng.choice(["batch_size", "seq_len", "lora_r"]), _pick(rng, INTS)
            v = int(value) if value.lstrip("-").isdigit() else value
            cases.append((f"estimate(gpt2, {field}={value[:12]!r})", lambda f=field, v=v: memplan.estimate("gpt2", **{f: v}),
                          ok))
        elif kind == "setup":
            field, value = rng.choice([("technique", "bogus"), ("precision", 16), ("batch_size", 2.5),
                                       ("lora_dropout", "x"), ("trainable", -3), ("sharding", None)])
            cases.append((f"Setup({field}={value!r})", lambda f=field, v=value: Setup(**{f: v}), False))
        elif kind == "fit":
            gpu, ok = rng.choice([("t4", True), ("nope", False), (None, False), (12, False)])
            cases.append((f"fit(gpt2, {gpu!r})", lambda g=gpu: memplan.fit(memplan.load_spec("gpt2"),
                                                                         memplan.find_gpu(g)), ok))
        elif kind == "plan":
            kw = rng.choice([{"gpu": "t4"}, {"gpu": "t4", "effective_batch": 0}, {"gpu": "t4", "prefer": "fast"},
                             {"gpu": "t4", "headroom": 2.0}, {"gpu": "t4", "host_memory": "abc"}, {"memory": "0.5b"}])
            ok = kw == {"gpu": "t4"}
            cases.append((f"plan(gpt2, {kw})", lambda k=kw: memplan.plan("gpt2", **k), ok))
        elif kind == "check":
            path, ok = _pick(rng, files["csv"])
            cases.append((f"check({path!r})", lambda p=path: memplan.check(p), ok))
        elif kind == "load_spec":
            path, ok = _pick(rng, files["config"] + MODELS)
            cases.append((f"load_spec({path!r})", lambda p=path: memplan.load_spec(p), ok))
        elif kind == "find_gpu":
            gpu, ok = _pick(rng, GPUS)
            cases.append((f"find_gpu({gpu!r})", lambda g=gpu: memplan.find_gpu(g), ok))
        else:
            budget, ok = rng.choice([(12 * 2**30, True), (0, False), (-5, False), ("12GiB", False)])
            cases.append((f"diagnose(gpt2, budget={budget!r})",
                          lambda b=budget: memplan.diagnose(memplan.load_spec("gpt2"), Setup(), b), ok))
    return cases


class _Hang(Exception):
    pass


@contextlib.contextmanager
def _limit(seconds: int):
    def alarm(*_):
        raise _Hang()
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run(seed: int, n_cli: int, n_api: int) -> dict:
    from click.testing import CliRunner

    from memplan.cli.main import main
    from memplan.errors import MemplanError
    rng = random.Random(seed)
    runner = CliRunner()
    broken: list[str] = []
    counts = {"cli": 0, "api": 0, "tracebacks": 0, "hangs": 0, "bad_input_not_2": 0, "api_wrong_exception": 0,
              "api_invalid_accepted": 0}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        files = _files(tmp)
        files["tmp"] = tmp
        files["plan"] = _plan_files(tmp, runner, main)
        t0 = time.perf_counter()
        for _ in range(n_cli):
            args, valid = _cli_case(rng, files)
            counts["cli"] += 1
            try:
                with _limit(HANG_S):
                    r = runner.invoke(main, args)
            except _Hang:
                counts["hangs"] += 1
                broken.append(f"hang > {HANG_S} s: memplan {' '.join(a[:40] for a in args)}")
                continue
            exc = r.exception if not isinstance(r.exception, SystemExit) else None
            if exc is not None or "Traceback" in r.output:
                counts["tracebacks"] += 1
                last = "".join(traceback.format_exception_only(type(exc), exc)).strip() if exc else ""
                broken.append(f"traceback: memplan {' '.join(a[:40] for a in args)} -> {last[:160]}")
            elif valid is False and r.exit_code != 2:
                counts["bad_input_not_2"] += 1
                broken.append(f"bad input exited {r.exit_code}: memplan {' '.join(a[:40] for a in args)}")
        cli_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for label, call, valid in _api_cases(rng, files)[:n_api]:
            counts["api"] += 1
            try:
                with _limit(HANG_S):
                    call()
                if not valid:
                    counts["api_invalid_accepted"] += 1
                    broken.append(f"invalid argument accepted: {label}")
            except _Hang:
                counts["hangs"] += 1
                broken.append(f"hang > {HANG_S} s: {label}")
            except MemplanError:
                pass
            except Exception as e:  # noqa: BLE001 - the campaign records what escapes
                counts["api_wrong_exception"] += 1
                broken.append(f"{type(e).__name__} escaped: {label}: {str(e).splitlines()[0][:120] if str(e) else ''}")
        api_s = time.perf_counter() - t0
    return {"seed": seed, "counts": counts, "broken": broken, "cli_s": cli_s, "api_s": api_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=41)
    ap.add_argument("--cli", type=int, default=1000)
    ap.add_argument("--api", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fuzz_campaign.md"))
    args = ap.parse_args(argv)
    res = run(args.seed, args.cli, args.api)
    c = res["counts"]
    import datetime
    import platform

    from memplan import __version__
    stamp = f"{datetime.date.today()} · memplan {__version__} · Python {platform.python_version()}"
    lines = ["# Fuzz campaign", "", stamp, "", f"`python benchmarks/fuzz_campaign.py --seed {res['seed']} --cli {args.cli} "
             f"--api {args.api}`: {c['cli']} CLI cases in {res['cli_s']:.0f} s, {c['api']} API cases in "
             f"{res['api_s']:.0f} s.", "",
             "| rule | broken |", "|---|---:|",
             f"| no traceback (CLI) | {c['tracebacks']} |", f"| no hang (> {HANG_S} s) | {c['hangs']} |",
             f"| bad input exits 2 (CLI) | {c['bad_input_not_2']} |",
             f"| only memplan's errors escape (API) | {c['api_wrong_exception']} |",
             f"| invalid arguments refused (API) | {c['api_invalid_accepted']} |", ""]
    if res["broken"]:
        lines += ["## Broken cases", ""] + [f"- {b}" for b in sorted(set(res["broken"]))] + [""]
    from memplan.fileio import write_text_atomic
    write_text_atomic(Path(args.out), "\n".join(lines))
    print("\n".join(lines))
    return 0 if not res["broken"] else 1


if __name__ == "__main__":
    sys.exit(main())

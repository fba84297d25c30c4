"""The coverage sweep: every small transformers architecture and diffusers' three models,
captured and trained by magis against eager PyTorch (see yardstick/coverage.py).

Each architecture runs in a forked child (its own memory; killed past --timeout);
results go to results/coverage.json and a markdown table results/coverage.md.

    python experiments/coverage_sweep.py                     # the full sweep (about an hour on 2 cores)
    python experiments/coverage_sweep.py --sample            # the CI sample: distinct op sets, a few minutes
    python experiments/coverage_sweep.py --only Bert,T5      # class names containing any of these
    python experiments/coverage_sweep.py --plan              # each passing one also planned and its plan run
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from driver import write_json
from tqdm import tqdm

from yardstick.coverage import (
    SAMPLE,
    SAMPLE_SIZE,
    Architecture,
    Summary,
    Verdict,
    architectures,
    check,
    choose_sample,
)


def _child(arch: Architecture, plan: bool, queue: multiprocessing.Queue) -> None:
    queue.put(check(arch, plan=plan))


@dataclass
class _Running:
    arch: Architecture
    child: multiprocessing.Process
    queue: multiprocessing.Queue
    deadline: float


def check_isolated(chosen: list[Architecture], timeout: float, jobs: int, plan: bool = False) -> Iterator[Verdict]:
    """:func:`check` each architecture in a forked child, ``jobs`` at a time, in any order; a
    child that overruns ``timeout`` is killed (``timed out``), one that dies says so (``wrong``)."""
    context = multiprocessing.get_context("fork")
    waiting, running = list(chosen), []
    while waiting or running:
        while waiting and len(running) < jobs:
            arch, queue = waiting.pop(0), context.Queue()
            child = context.Process(target=_child, args=(arch, plan, queue))
            child.start()
            running.append(_Running(arch, child, queue, time.monotonic() + timeout))
        time.sleep(0.2)
        for job in list(running):
            if not job.queue.empty():
                verdict = job.queue.get()
                job.child.join()
            elif job.child.is_alive() and time.monotonic() < job.deadline:
                continue
            elif job.child.is_alive():
                job.child.kill()
                job.child.join()
                verdict = Verdict(job.arch.name, job.arch.task, "timed out", f"no answer within {timeout:.0f} s")
            else:
                verdict = Verdict(job.arch.name, job.arch.task, "wrong", f"the process died ({job.child.exitcode})")
            running.remove(job)
            yield verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sample", action="store_true", help="only the CI sample of distinct op sets")
    parser.add_argument("--only", default="", help="comma-separated parts of class names to keep")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per architecture (default 120)")
    parser.add_argument("--jobs", type=int, default=1, help="architectures checked at once (default 1)")
    parser.add_argument("--plan", action="store_true", help="also plan each passing one and run the plan beside eager")
    parser.add_argument("--out", default="results/coverage", help="path prefix of the .json and .md written")
    args = parser.parse_args()

    chosen = architectures()
    if args.sample:
        chosen = [a for a in chosen if a.name in SAMPLE]
    if args.only:
        parts = [p for p in args.only.split(",") if p]
        chosen = [a for a in chosen if any(p in a.class_name for p in parts)]
    verdicts = []
    with tqdm(total=len(chosen), desc="coverage", unit="model", file=sys.stderr) as bar:
        for verdict in check_isolated(chosen, args.timeout, args.jobs, args.plan):
            verdicts.append(verdict)
            bar.update()
            summary = Summary(verdicts)
            bar.set_postfix_str(f"pass {summary.count('pass')}/{summary.counted}, wrong {summary.count('wrong')}")
            if verdict.status == "wrong":
                tqdm.write(f"WRONG {verdict.architecture}: {verdict.cause}", file=sys.stderr)
    order = {a.name: i for i, a in enumerate(chosen)}
    summary = Summary(sorted(verdicts, key=lambda v: order[v.architecture]))
    out = Path(args.out)
    write_json(out.with_suffix(".json"), summary.to_json())
    out.with_suffix(".md").write_text(summary.markdown())
    print(
        f"{summary.count('pass')}/{summary.counted} pass ({summary.pass_rate:.1%}), "
        f"{summary.count('refused')} refused, {summary.count('wrong')} wrong; "
        f"not counted: {summary.count('eager fails')} eager fails, {summary.count('not built')} not built, "
        f"{summary.count('timed out')} timed out. "
        f"Wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}"
    )
    if not args.sample:
        print(f"sample covering the most distinct operators: {choose_sample(verdicts, SAMPLE_SIZE)}")


if __name__ == "__main__":
    main()

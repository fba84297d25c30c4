"""The coverage sweep: every small transformers architecture and diffusers' three models,
captured and trained by magis against eager PyTorch (see magis/bench/coverage.py).

Each architecture runs in a forked child (its own memory; killed past --timeout);
results go to results/coverage.json and a markdown table results/coverage.md.

    python bench/coverage.py                     # the full sweep (about an hour on 2 cores)
    python bench/coverage.py --sample            # the CI sample: distinct op sets, a few minutes
    python bench/coverage.py --only Bert,T5      # class names containing any of these
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from pathlib import Path

from driver import write_json
from tqdm import tqdm

from magis.bench.coverage import (
    SAMPLE,
    SAMPLE_SIZE,
    Architecture,
    Summary,
    Verdict,
    architectures,
    check,
    choose_sample,
)


def _child(arch: Architecture, queue: multiprocessing.Queue) -> None:
    queue.put(check(arch))


def check_isolated(arch: Architecture, timeout: float) -> Verdict:
    """:func:`check` in a forked child; a child that overruns or dies gets a verdict saying so."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(arch, queue))
    child.start()
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
        return Verdict(arch.name, arch.task, "wrong", f"no answer within {timeout:.0f} s", seconds=timeout)
    if queue.empty():
        return Verdict(arch.name, arch.task, "wrong", f"the process died (exit code {child.exitcode})")
    return queue.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sample", action="store_true", help="only the CI sample of distinct op sets")
    parser.add_argument("--only", default="", help="comma-separated parts of class names to keep")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per architecture (default 300)")
    parser.add_argument("--out", default="results/coverage", help="path prefix of the .json and .md written")
    args = parser.parse_args()

    chosen = architectures()
    if args.sample:
        chosen = [a for a in chosen if a.name in SAMPLE]
    if args.only:
        parts = [p for p in args.only.split(",") if p]
        chosen = [a for a in chosen if any(p in a.class_name for p in parts)]
    verdicts = []
    with tqdm(chosen, desc="coverage", unit="model", file=sys.stderr) as bar:
        for arch in bar:
            verdict = check_isolated(arch, args.timeout)
            verdicts.append(verdict)
            summary = Summary(verdicts)
            bar.set_postfix_str(f"pass {summary.count('pass')}/{summary.counted}, wrong {summary.count('wrong')}")
            if verdict.status == "wrong":
                tqdm.write(f"WRONG {verdict.architecture}: {verdict.cause}", file=sys.stderr)
    summary = Summary(verdicts)
    out = Path(args.out)
    write_json(out.with_suffix(".json"), summary.to_json())
    out.with_suffix(".md").write_text(summary.markdown())
    print(
        f"{summary.count('pass')}/{summary.counted} pass ({summary.pass_rate:.1%}), "
        f"{summary.count('refused')} refused, {summary.count('wrong')} wrong; "
        f"not counted: {summary.count('eager fails')} eager fails, {summary.count('not built')} not built. "
        f"Wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}"
    )
    if not args.sample:
        print(f"sample covering the most distinct operators: {choose_sample(verdicts, SAMPLE_SIZE)}")


if __name__ == "__main__":
    main()

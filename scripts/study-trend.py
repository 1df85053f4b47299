#!/usr/bin/env python3
"""The pooled gain of several arms over a baseline at each setting of a study, and its change
between settings, with the study report's paired bootstrap (seeds and questions drawn with
replacement, 2,000 resamples, generator seed 2000). Standard library only.

    python3 scripts/study-trend.py runs/credit-density --methods mt-grpo,a2tgpo,igpo,ppo \
        --baseline grpo --settings rho-1,rho-0.5,rho-0.33 --step 30

Arms are named `<method>-<setting>` (as in studies/credit-density.toml); each run's greedy test
evaluation after RL is `runs/<arm>/seed-<s>/evals/test-greedy-step-<step>.jsonl(.gz)`, one line
per panel question with its `em`. Prints, in EM points with a 95 % interval: the mean over the
methods of (method − baseline) at each setting, and its difference between each setting and the
first.
"""

import argparse
import gzip
import json
import os
import random


def read_em(path):
    opener = open
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        path, opener = path + ".gz", gzip.open
    with opener(path, "rt") as f:
        return {r["question_id"]: float(r["em"]) for r in map(json.loads, f)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("study")
    ap.add_argument("--methods", required=True)
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--settings", required=True)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--resamples", type=int, default=2000)
    a = ap.parse_args()
    methods = a.methods.split(",")
    settings = a.settings.split(",")
    seeds = [int(s) for s in a.seeds.split(",")]
    data = {}
    for st in settings:
        for m in [a.baseline] + methods:
            for s in seeds:
                path = os.path.join(
                    a.study, "runs", f"{m}-{st}", f"seed-{s}", "evals",
                    f"test-greedy-step-{a.step:05d}.jsonl",
                )
                data[(m, st, s)] = read_em(path)
    questions = sorted(data[(a.baseline, settings[0], seeds[0])])
    for key, em in data.items():
        if sorted(em) != questions:
            raise SystemExit(f"{key}: its panel is not the first run's")

    def gain(st, s, q):
        base = data[(a.baseline, st, s)][q]
        return sum(data[(m, st, s)][q] - base for m in methods) / len(methods)

    def mean_over(ss, qq, f):
        v = [f(s, q) for s in ss for q in qq]
        return sum(v) / len(v)

    stats = [(f"gain at {st}", (lambda st: lambda s, q: gain(st, s, q))(st)) for st in settings]
    stats += [
        (f"{st} - {settings[0]}", (lambda st: lambda s, q: gain(st, s, q) - gain(settings[0], s, q))(st))
        for st in settings[1:]
    ]
    rng = random.Random(2000)
    lo_i, hi_i = int(0.025 * a.resamples), int(0.975 * a.resamples) - 1
    for label, f in stats:
        point = mean_over(seeds, questions, f)
        boots = sorted(
            mean_over(
                [rng.choice(seeds) for _ in seeds],
                [rng.choice(questions) for _ in questions],
                f,
            )
            for _ in range(a.resamples)
        )
        print(f"{label}: {100 * point:+.1f} [{100 * boots[lo_i]:+.1f}, {100 * boots[hi_i]:+.1f}]")


if __name__ == "__main__":
    main()

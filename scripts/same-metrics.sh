#!/usr/bin/env bash
# Same metrics before and after a change that must not change behaviour (issue 34): trains every
# preset BEFORE_BIN lists with both binaries, from the same fixed seed (each preset's own), on a
# tiny world and model for a few RL steps, and compares what the runs wrote.
#
#   scripts/same-metrics.sh BEFORE_BIN AFTER_BIN [WORKDIR]
#
# WORKDIR (default target/same-metrics) receives WORKDIR/{before,after}/warm/<format> (one warm
# start per agent format, made by each binary: `sft` of the format's first preset with
# sft.steps=600, batch 8, no rejection sampling and no judge, as tests/presets.rs shares one per
# format; 600 rather than the test's 300 steps so that most groups carry signal and DAPO's
# filter keeps some), WORKDIR/{before,after}/runs/<preset> (the runs),
# WORKDIR/{before,after}/logs/ and WORKDIR/judge/ (mt-ppo-judge's judge: the tiny GGUF fixture
# with its context raised to 8192 tokens, as tests/presets.rs does; SmolLM2 is not offline).
#
# Each run is `train --preset P` as shipped but for the size of the world and the model
# (tests/common/mod.rs's tiny overrides), room for whole turns (max_turn_tokens 48, response 240),
# RL_STEPS (default 3) RL steps, the warm start of its format (model.init_from, sft.steps=0) and a
# smaller batch: fewer prompts per step with the mini-batch scaled in proportion so that the
# update structure (optimizer steps per batch) is the preset's own (tests/presets.rs's
# scaled_batch; checked with `config`). Group size, lr, epochs, loss, advantage, rejection
# sampling and evaluations are the preset's own.
#
# Compared, per preset: metrics.jsonl, every samples/*.jsonl and evals/*.jsonl line by line, key
# by key in the order written, each number's JSON text exactly as written (numbers are not
# re-parsed as floats and nothing is re-serialised: key order is compared too, so a line equals
# when its bytes do once the wall-clock keys are cut out, up to JSON whitespace), and the last
# checkpoint's model.safetensors byte for byte. Per format, the warm start's model.safetensors
# byte for byte. The wall-clock keys stripped (the only ones; printed at the end with the number
# of values stripped):
#   time        (every metrics line: seconds since the Unix epoch)
#   timing_s/*  (timing_s/setup, warm_start, eval, gen, update, step, info_gain, ...: seconds)
#   perf/throughput (verl's: the step's tokens per second)
# Everything else must be identical; a key present on one side only is a difference.
#
# Prints one line per warm start and per preset (identical, or the first difference: file, line,
# key, before vs after) and a summary; exits 1 on any difference or failed run, 2 on bad usage.
# Runs sequentially; 12 minutes on this 2-core machine while it was busy (the six warm starts
# about 7, mt-ppo-judge's in-run judge 2.5). PRESETS="grpo ppo" restricts it to those presets. Comparing a binary with itself checks
# that every preset is deterministic from its seed.
set -euo pipefail

if [ $# -lt 2 ] || [ $# -gt 3 ]; then
    echo "usage: $0 BEFORE_BIN AFTER_BIN [WORKDIR]" >&2
    exit 2
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
abs() { (cd "$(dirname "$1")" && echo "$(pwd)/$(basename "$1")"); }
before=$(abs "$1")
after=$(abs "$2")
for b in "$before" "$after"; do
    [ -x "$b" ] || { echo "not an executable: $b" >&2; exit 2; }
done
work=${3:-$repo/target/same-metrics}
mkdir -p "$work"
work=$(cd "$work" && pwd)
rl_steps=${RL_STEPS:-3}
rm -rf "$work/before" "$work/after" "$work/judge" "$work/stripped.tsv"
mkdir -p "$work"/{before,after}/{warm,runs,logs} "$work/judge"

# The tiny world and model of crates/turnwise/tests/common/mod.rs (without its batch), and room
# for whole turns (tests/presets.rs's ROOM).
world=(--set task.world.countries=4 --set task.world.cities=8 --set task.world.companies=6
    --set task.world.persons=16 --set task.world.questions.train=40
    --set task.world.questions.validation=8 --set task.world.questions.test=8
    --set model.hidden_size=32 --set model.num_layers=2 --set model.num_heads=4
    --set model.num_kv_heads=2 --set model.intermediate_size=64
    --set rollout.max_turn_tokens=48 --set rollout.max_response_tokens=240)

mapfile -t presets < <("$before" presets | grep -oE '^[a-z0-9][a-z0-9-]*' | grep -vx preset)
mapfile -t presets_after < <("$after" presets | grep -oE '^[a-z0-9][a-z0-9-]*' | grep -vx preset)
[ ${#presets[@]} -gt 0 ] || { echo "$before presets listed none" >&2; exit 1; }
failures=0
# The same presets, in whatever order each binary lists them (`turnwise presets` lists them by
# name since issue 53; before, in a hand-written order).
if [ "$(printf '%s\n' "${presets[@]}" | sort)" != "$(printf '%s\n' "${presets_after[@]}" | sort)" ]; then
    echo "presets differ: before [${presets[*]}] vs after [${presets_after[*]}]"
    failures=$((failures + 1))
fi
all_presets=("${presets[@]}")
if [ -n "${PRESETS:-}" ]; then
    read -r -a presets <<<"$PRESETS"
fi
echo "presets (${#presets[@]}): ${presets[*]}"
echo "before: $before"
echo "after:  $after"
echo "workdir: $work, $rl_steps RL steps per preset"

# mt-ppo-judge's judge: the tiny GGUF fixture, context length 256 -> 8192 (RoPE positions are
# computed) so that the rubric prompt fits.
judge="$work/judge/tiny-llama-8k.gguf"
python3 - "$repo/crates/turnwise-model/src/checkpoint/fixtures/gguf/tiny-llama.gguf" "$judge" <<'PY'
import struct, sys
data = bytearray(open(sys.argv[1], "rb").read())
key = b"llama.context_length"
at = data.index(key) + len(key)
# After the key: its value type (u32) and the u32 value.
assert struct.unpack_from("<I", data, at + 4)[0] == 256, "fixture context length is not 256"
struct.pack_into("<I", data, at + 4, 8192)
open(sys.argv[2], "wb").write(data)
PY

# The comparison of two run directories (or two warm starts): prints "identical (...)", or the
# first difference, or why a run failed; appends the wall-clock keys it cut, with counts, to
# WORKDIR/stripped.tsv.
compare_py=$(cat <<'PY'
import glob, json, os, sys

def stripped(key):
    """The wall-clock keys (the script's header lists them)."""
    return key == "time" or key.startswith("timing_s/") or key == "perf/throughput"

class Raw(str):
    """A number's JSON text as written (never re-serialised)."""

class Obj(list):
    """A JSON object: its (key, value) pairs in the order written."""

strip_counts = {}

def load(line):
    return json.loads(line, object_pairs_hook=Obj, parse_float=Raw, parse_int=Raw)

def clean(v):
    """`v` without its wall-clock keys (at any depth), counting what was cut."""
    if isinstance(v, Obj):
        out = Obj()
        for k, x in v:
            if stripped(k):
                strip_counts[k] = strip_counts.get(k, 0) + 1
            else:
                out.append((k, clean(x)))
        return out
    if isinstance(v, list):
        return [clean(x) for x in v]
    return v

def show(v):
    if isinstance(v, Obj):
        return "{" + ", ".join(k for k, _ in v)[:100] + "}"
    if isinstance(v, Raw):
        return str(v)
    return json.dumps(v)[:100]

def first_diff(a, b, where):
    """The first (key path, before, after) where `a` and `b` differ, or None."""
    if isinstance(a, Obj) and isinstance(b, Obj):
        for i in range(max(len(a), len(b))):
            if i >= len(a):
                return (where + b[i][0], "(absent)", show(b[i][1]))
            if i >= len(b):
                return (where + a[i][0], show(a[i][1]), "(absent)")
            (ka, va), (kb, vb) = a[i], b[i]
            if ka != kb:
                return (f"{where}#{i}", f"key {ka}", f"key {kb}")
            d = first_diff(va, vb, where + ka + ".")
            if d:
                return d
        return None
    if type(a) is list and type(b) is list:
        if len(a) != len(b):
            return (where.rstrip(".") + " length", str(len(a)), str(len(b)))
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_diff(x, y, where.rstrip(".") + f"[{i}].")
            if d:
                return d
        return None
    if type(a) is not type(b) or a != b:
        return (where.rstrip("."), show(a), show(b))
    return None

def compare_jsonl(fa, fb, rel):
    la = open(fa).read().splitlines()
    lb = open(fb).read().splitlines()
    for n in range(min(len(la), len(lb))):
        d = first_diff(clean(load(la[n])), clean(load(lb[n])), "")
        if d:
            key, x, y = d
            return f"differs at {rel} line {n + 1} key {key}: {x} vs {y}"
    if len(la) != len(lb):
        return f"differs: {rel} has {len(la)} lines before vs {len(lb)} after"
    return None

def compare_bytes(fa, fb, rel):
    if open(fa, "rb").read() != open(fb, "rb").read():
        return f"differs: {rel} bytes ({os.path.getsize(fa)} vs {os.path.getsize(fb)})"
    return None

def files(root, pattern):
    return sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, pattern)))

def compare_runs(a, b, rl_steps):
    for d in (a, b):
        if not os.path.isfile(os.path.join(d, "metrics.jsonl")):
            return f"failed: no {d}/metrics.jsonl"
    lines = 0
    for pattern in ["metrics.jsonl", "samples/*.jsonl", "evals/*.jsonl"]:
        fa, fb = files(a, pattern), files(b, pattern)
        if fa != fb:
            return f"differs: {pattern} files {fa} vs {fb}"
        for rel in fa:
            r = compare_jsonl(os.path.join(a, rel), os.path.join(b, rel), rel)
            if r:
                return r
            lines += sum(1 for _ in open(os.path.join(a, rel)))
    # Not vacuous: the run trained, one train line per RL step.
    train = sum(1 for l in open(os.path.join(a, "metrics.jsonl")) if '"phase":"train"' in l)
    if train != rl_steps:
        return f"failed: {train} train lines in metrics.jsonl, expected {rl_steps}"
    ca, cb = files(a, "checkpoints/step-*"), files(b, "checkpoints/step-*")
    if ca != cb:
        return f"differs: checkpoints {ca} vs {cb}"
    if not ca:
        return "failed: no checkpoint"
    rel = os.path.join(ca[-1], "model.safetensors")
    r = compare_bytes(os.path.join(a, rel), os.path.join(b, rel), rel)
    if r:
        return r
    samples = len(files(a, "samples/*.jsonl"))
    return f"identical ({lines} jsonl lines: metrics, {samples} sample files, evals; {rel} equal)"

mode, a, b, work = sys.argv[1:5]
if mode == "warm":
    rel = "model.safetensors"
    missing = [d for d in (a, b) if not os.path.isfile(os.path.join(d, rel))]
    if missing:
        print(f"failed: no {missing[0]}/{rel}")
    else:
        print(compare_bytes(os.path.join(a, rel), os.path.join(b, rel), rel)
              or f"identical ({rel} equal)")
else:
    print(compare_runs(a, b, int(sys.argv[5])))
with open(os.path.join(work, "stripped.tsv"), "a") as f:
    for k, n in sorted(strip_counts.items()):
        f.write(f"{k}\t{n}\n")
PY
)

# A preset's batch overrides: the smallest prompts per step from 2 whose rounded, proportional
# mini-batch keeps the preset's update structure (TrainConfig::update_structure).
scaled_batch() {
    # (judge.enabled = false: only the batch is read, and a judge preset needs an endpoint.)
    "$before" config --preset "$1" --set judge.enabled=false | python3 -c '
import sys, tomllib
c = tomllib.loads(sys.stdin.read())
p0, g = c["rollout"]["prompts_per_step"], c["rollout"]["group_size"]
m0, e = c["optim"]["mini_batch_size"], c["optim"]["ppo_epochs"]
def structure(p, m):
    rows = max(p * g, 1)
    mini = rows if m == 0 else min(m, rows)
    return -(-rows // mini) * e
want = structure(p0, m0)
for p in range(2, p0 + 1):
    m = 0 if m0 == 0 else max((2 * m0 * p + p0) // (2 * p0), 1)
    if structure(p, m) == want:
        print(f"{c['\''task'\'']['\''format'\'']} {p} {m} {want}")
        break
else:
    sys.exit(f"{sys.argv[1]}: no smaller batch keeps the update structure {want}")
' "$1"
}

# The warm start of a format is made with the first listed preset in that format (whatever
# PRESETS selects).
declare -A warm_preset=() warm_done=()
for p in "${all_presets[@]}"; do
    read -r format _ < <(scaled_batch "$p")
    [ -n "${warm_preset[$format]:-}" ] || warm_preset[$format]=$p
done
t_all=$SECONDS
for p in "${presets[@]}"; do
    read -r format prompts mini opt_steps < <(scaled_batch "$p")
    if [ -z "${warm_done[$format]:-}" ]; then
        warm_done[$format]=1
        for side in before after; do
            bin=${!side}
            "$bin" -q sft --preset "${warm_preset[$format]}" --out "$work/$side/warm/$format" --overwrite "${world[@]}" \
                --set sft.steps=600 --set sft.batch_size=8 --set rsft.enabled=false \
                --set judge.enabled=false >"$work/$side/logs/warm-$format.log" 2>&1 ||
                echo "($side warm start $format failed: $work/$side/logs/warm-$format.log)"
        done
        r=$(python3 -c "$compare_py" warm "$work/before/warm/$format" "$work/after/warm/$format" \
            "$work")
        printf '%-13s %s [sft of %s]\n' "warm:$format" "$r" "${warm_preset[$format]}"
        [[ $r == identical* ]] || failures=$((failures + 1))
    fi
    extra=()
    [ "$p" = mt-ppo-judge ] && extra=(--set "judge.serve=\"$judge\"")
    for side in before after; do
        bin=${!side}
        side_extra=("${extra[@]}")
        # Since issue 49 a judge is calibrated against the rules before RL and the tiny fixture
        # judge is under the default floor: a binary that knows the key gets the floor at 0.
        if [ "$p" = mt-ppo-judge ] && "$bin" -q config --preset mt-ppo-judge \
            --set judge.min_rubric_agreement=0 "${extra[@]}" >/dev/null 2>&1; then
            side_extra+=(--set judge.min_rubric_agreement=0)
        fi
        t0=$SECONDS
        "$bin" train --preset "$p" --out "$work/$side/runs/$p" --overwrite "${world[@]}" \
            --set rollout.prompts_per_step="$prompts" --set optim.mini_batch_size="$mini" \
            --set run.steps="$rl_steps" --set sft.steps=0 \
            --set model.init_from="\"$work/$side/warm/$format\"" "${side_extra[@]}" \
            >"$work/$side/logs/$p.log" 2>&1 ||
            echo "($side run of $p failed: $work/$side/logs/$p.log)"
        echo "$((SECONDS - t0))" >"$work/$side/logs/$p.seconds"
    done
    r=$(python3 -c "$compare_py" run "$work/before/runs/$p" "$work/after/runs/$p" "$work" \
        "$rl_steps")
    [ "$mini" = 0 ] && mini="the whole batch"
    printf '%-13s %s [%s prompts per step, mini-batch %s, %s optimizer steps per batch; %s s + %s s]\n' \
        "$p" "$r" "$prompts" "$mini" "$opt_steps" \
        "$(cat "$work/before/logs/$p.seconds")" "$(cat "$work/after/logs/$p.seconds")"
    [[ $r == identical* ]] || failures=$((failures + 1))
done

echo "wall-clock keys stripped (values cut, both sides):"
awk -F'\t' '{n[$1] += $2} END {for (k in n) printf "  %s %d\n", k, n[k]}' "$work/stripped.tsv" | sort
rm -f "$work/stripped.tsv"
checked=$(( ${#presets[@]} + ${#warm_done[@]} ))
if [ "$failures" -eq 0 ]; then
    echo "summary: all identical (${#presets[@]} presets, ${#warm_done[@]} warm starts) in $((SECONDS - t_all)) s"
else
    echo "summary: $failures of $checked comparisons differ or failed, in $((SECONDS - t_all)) s"
    exit 1
fi

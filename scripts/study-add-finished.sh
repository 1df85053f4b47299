#!/usr/bin/env bash
# Stages the finished runs of a study directory for a commit, so that a study that takes longer
# than one machine's lease survives it: `turnwise study run` skips a run whose summary.json is
# there, so a later checkout resumes with the runs not yet finished. A study's runs are not kept
# once its report is committed (.gitignore ignores warm/, runs/, logs/; docs/runs.md: "Method
# comparison studies"), so this stages them on purpose (`git add -f`) for the study in progress;
# `git rm -r --cached DIR/warm DIR/runs DIR/logs` when it has finished. Checkpoints and the arms'
# copies of the warm-start model stay out; warm/<name>/warm-start-model, which the arms start
# from, goes in.
#
#   scripts/study-add-finished.sh studies/paper-claims && git commit -m "..."
set -euo pipefail
dir=${1:?usage: scripts/study-add-finished.sh STUDY_DIR}
cd "$(git rev-parse --show-toplevel)"
[ -f "$dir/study.toml" ] || { echo "$dir is not a study directory (no study.toml)" >&2; exit 2; }
git add "$dir/study.toml" "$dir/panel.json" "$dir/.turnwise-study"
n=0
for run in "$dir"/warm/* "$dir"/runs/*/*; do
  [ -d "$run" ] || continue
  if [ -f "$run/summary.json" ] && python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$run/summary.json" 2>/dev/null; then
    find "$run" -type f ! -path '*/checkpoints/*' ! -path '*/runs/*/warm-start-model/*' -print0 \
      | xargs -0 git add -f --
    case "$run" in
      */warm/*) log="$dir/logs/warm-$(basename "$run").log" ;;
      *) log="$dir/logs/$(basename "$(dirname "$run")")-$(basename "$run").log" ;;
    esac
    [ -f "$log" ] && git add -f "$log"
    n=$((n + 1))
  fi
done
echo "staged $n finished runs of $dir"

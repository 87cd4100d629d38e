#!/usr/bin/env bash
# A dependent chain of jobs in one command: each stage starts when the one before has succeeded
# (--dependency=afterok; a failed stage cancels the rest). Prints the job ids, one per line.
#   bash slurm/chain.sh [--name NAME] [SBATCH FLAGS] :: STAGE :: STAGE ...
# A STAGE is what slurm/submit.sh takes: [SBATCH FLAGS] SCRIPT [ARGS]. Every stage has a folder,
# <LAPLACE_RUNS>/chains/<NAME>/<i>_<label> (label: its experiment=, else the script's name); a
# training stage (train.sbatch, or a command with train.py) trains there unless it sets run_dir=.
# In ARGS, {1}, {2}, ... stand for the folder of that stage and {prev} for the previous one's:
#   bash slurm/chain.sh \
#     :: train.sbatch experiment=deit3_in1k model=vitb_12L \
#     :: train.sbatch experiment=deit3_in1k_ft224 model=vitb_12L 'trainer.init_from={1}/ckpt/last.pt' \
#     :: analysis.sbatch 'checkpoint={2}/ckpt/last.pt'
#   (slurm/chains/deit3_in1k.sh is this chain for any model.) Later stages plug in the same way:
#     :: run.sbatch python -m <evaluation module> 'checkpoint={1}/ckpt/last.pt' ...
# NAME defaults to stage 1's arguments (deit3_in1k_vitb_12L_s0 here; data.root=/d -> data.root--d):
# the same command names the same folders, so re-submitting a chain resumes its unfinished stage
# (finished stages end at once). A folder Hydra cannot take unquoted is passed single-quoted.
# SBATCH FLAGS before the first :: apply to every stage; a stage's own come after them and win.
# A stage's --after=N[,M...] (ours, not sbatch's) makes it wait for stages N, M... instead of the
# previous one: two stages with --after=1 run side by side once stage 1 has succeeded.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/slurm/config.sh"
usage="usage: bash slurm/chain.sh [--name NAME] [SBATCH FLAGS] :: [FLAGS] SCRIPT [ARGS] :: ..."

name='' common=()
while [ $# -gt 0 ] && [ "$1" != "::" ]; do
  case $1 in
    --name) name=$2; shift 2 ;;
    --name=*) name=${1#*=}; shift ;;
    -*) common+=("$1"); shift ;;
    *) echo "chain.sh: '$1' before the first ::; $usage" >&2; exit 2 ;;
  esac
done
[ $# -gt 1 ] || { echo "$usage" >&2; exit 2; }
args=("$@")
starts=()  # index in args of each stage's first word
for i in "${!args[@]}"; do [ "${args[i]}" != "::" ] || starts+=($(( i + 1 ))); done
starts+=($(( ${#args[@]} + 1 )))
n=$(( ${#starts[@]} - 1 ))

# value KEY WORDS...: the value of the first KEY=value word, or nothing.
value() { local k=$1 w; shift; for w in "$@"; do [[ $w != "$k="* ]] || { echo "${w#*=}"; return; }; done; }
# quoted VALUE: VALUE as one Hydra override value. Folders may hold what Hydra's grammar reads as
# syntax ('=' ',' '~' '&' ' ' from a run name, --name or LAPLACE_RUNS): those go in single quotes.
quoted() {
  if [[ $1 =~ ^[A-Za-z0-9_./+:@-]*$ ]] || [[ $1 == \'*\' ]]; then echo "$1"; else local v=${1//\'/\\\'}; echo "'$v'"; fi
}

if [ -z "$name" ]; then  # from stage 1's arguments: experiment and model values, s<seed>, other overrides
  parts=()
  for w in "${args[@]:${starts[0]}:$(( starts[1] - starts[0] - 1 ))}"; do
    case $w in
      -* | *.sbatch | run_dir=* | *'{'*) ;;
      experiment=* | model=*) parts+=("${w#*=}") ;;
      seed=*) parts+=("s${w#*=}") ;;
      *=*) parts+=("$w") ;;
    esac
  done
  # Only characters that every stage may take unquoted in a Hydra override (run_dir=, {N}):
  # data.root=/d -> data.root--d.
  name=$(IFS=_; echo "${parts[*]:-chain}" | tr -c 'A-Za-z0-9_.+\n-' '-')
  [ ${#name} -le 100 ] || name="${name:0:89}-$(echo -n "$name" | sha1sum | cut -c1-10)"
fi
runs=$LAPLACE_RUNS
dirs=() ids=() prev=''
for (( s = 0; s < n; s++ )); do
  stage=("${args[@]:${starts[s]}:$(( starts[s + 1] - starts[s] - 1 ))}")
  flags=() deps=$prev
  while [ ${#stage[@]} -gt 0 ] && [[ ${stage[0]} == -* ]]; do
    if [[ ${stage[0]} == --after=* ]]; then  # the job ids of the stages named
      deps=''
      IFS=, read -r -a on <<< "${stage[0]#*=}"
      for j in "${on[@]}"; do
        if ! [[ $j =~ ^[0-9]+$ ]] || [ "$j" -lt 1 ] || [ "$j" -gt "$s" ]; then
          echo "chain.sh: stage $(( s + 1 )): ${stage[0]} names no earlier stage (1..$s)" >&2; exit 2
        fi
        deps+=${deps:+:}${ids[j - 1]}
      done
    else
      flags+=("${stage[0]}")
    fi
    stage=("${stage[@]:1}")
  done
  [ ${#stage[@]} -gt 0 ] || { echo "chain.sh: stage $(( s + 1 )) names no script; $usage" >&2; exit 2; }
  script=${stage[0]} rest=("${stage[@]:1}")
  label=$(value experiment "${rest[@]}"); label=${label:-$(basename "$script" .sbatch)}
  dir=$(value run_dir "${rest[@]}"); dir=${dir:-$runs/chains/$name/$(( s + 1 ))_$label}
  dirs+=("$dir")
  words=()
  for w in "${rest[@]}"; do
    v=$w
    # The folder in double quotes: bash 5.2 would read a '&' in it as the matched text.
    [ -z "$prev" ] || v=${v//\{prev\}/"${dirs[s - 1]}"}
    for (( j = 1; j <= s; j++ )); do v=${v//\{$j\}/"${dirs[j - 1]}"}; done
    if [[ $v =~ \{(prev|[0-9]+)\} ]]; then echo "chain.sh: stage $(( s + 1 )): '$v' names no earlier stage" >&2; exit 2; fi
    # key=value with a folder in it: the value quoted (a list, key=[...], is left as written)
    [ "$v" = "$w" ] || [[ $v != *=* ]] || [[ ${v#*=} == \[* ]] || v="${v%%=*}=$(quoted "${v#*=}")"
    words+=("$v")
  done
  if [ "$(basename "$script")" = train.sbatch ] || [[ " ${rest[*]} " == *" train.py "* ]]; then
    [ -n "$(value run_dir "${rest[@]}")" ] || words+=("run_dir=$(quoted "$dir")")
  fi
  after=()
  [ -z "$deps" ] || after=(--dependency="afterok:$deps" --kill-on-invalid-dep=yes)
  prev=$(bash "$ROOT/slurm/submit.sh" --job-name="$label" "${after[@]}" "${common[@]}" "${flags[@]}" \
    "$script" "${words[@]}")
  ids+=("$prev")
  echo "$prev"
  echo "[chain] stage $(( s + 1 )): job $prev${after:+ (after ${after[0]#*:})}: $script ${words[*]}" >&2
done

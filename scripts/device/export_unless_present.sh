# Sourced by device scripts that need an artifact.
#   export_unless_present PATH LIMIT_S EXPORT_ARGS...   reuses PATH if it exists, else runs
#   `pt2serve export EXPORT_ARGS... -o PATH` within LIMIT_S seconds and prints how long it took; fails when
#   the export fails or times out.

export_unless_present() {
  local artifact=$1 limit=$2 start
  shift 2
  if [ -f "$artifact" ]; then
    echo "reusing $artifact"
    return 0
  fi
  start=$(date +%s)
  timeout "$limit" python3 -m pt2serve.cli export "$@" -o "$artifact" || { echo "export failed or timed out"; return 1; }
  echo "export seconds: $(( $(date +%s) - start ))"
}

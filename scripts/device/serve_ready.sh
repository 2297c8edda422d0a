# Sourced by device scripts that time `serve-artifact` from launch to ready.
#   start_server LOG ARGS...  starts `pt2serve serve-artifact ARGS...` in the background (output in LOG), its pid
#                             in $server and its launch time (epoch seconds) in $launched;
#   wait_ready URL LIMIT_S    waits for the first 200 from URL/health and sets $ready_s to the seconds from launch
#                             to it; fails (ready_s empty) when the server exits or LIMIT_S pass first.

start_server() {
  local log=$1; shift
  launched=$(date +%s.%N)
  python3 -m pt2serve.cli serve-artifact "$@" >"$log" 2>&1 &
  server=$!
}

wait_ready() {
  ready_s=$(python3 - "$1" "$2" "$launched" "$server" <<'PY'
import os, sys, time, urllib.request
url, limit, launched, pid = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
while time.time() - launched < limit:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as answer:
            if answer.status == 200:
                print(f"{time.time() - launched:.1f}")
                break
    except OSError:  # not listening yet, or 503 while loading (HTTPError is an OSError)
        pass
    try:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                break  # the server exited (a zombie until the shell that started it reaps it)
    except OSError:
        break  # the server exited and was reaped
    time.sleep(0.1)
PY
)
  [ -n "$ready_s" ]
}

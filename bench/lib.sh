# lib.sh — what the bench/run_*.sh scripts share (sourced): a free TCP port, and the wait for a
# server started in the background (PID) to answer /health.
#   . "$HERE/lib.sh"
#   free_port            prints a free port on 127.0.0.1
#   wait_up PORT         0 once http://127.0.0.1:PORT/health answers (120 s at most), 1 when
#                        the server (PID) exited first or never answered
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_up() {
    for _ in $(seq 1 600); do
        curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
        kill -0 "$PID" 2>/dev/null || return 1
        sleep 0.2
    done
    return 1
}

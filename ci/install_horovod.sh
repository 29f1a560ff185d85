#!/usr/bin/env bash
# The Horovod build ships inside the package (hvd_plugins/build/install_horovod.sh, run by the
# `hvd-build-horovod` command once the package is installed); CI runs the same file from the tree.
exec bash "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/hvd_plugins/build/install_horovod.sh" "$@"

#!/bin/sh
# Builds the native exchange worker (exchange_worker.cpp) into PREFIX/bin: `make setup` passes the
# venv, the image /opt/venv. One g++ line with pkg-config's flags (no build system to install in an
# image), after protoc generates the control messages' C++ (protos/fastdecode/v1/exchange.proto). Where gRPC C++ is missing, it installs it from Debian when it can (root
# with apt-get); where it cannot, it says so and exits 0, and `--exchange-worker auto` then takes
# the Python worker. With gRPC C++ present, a build that fails fails this script.
set -eu
prefix=$1
here=$(cd "$(dirname "$0")" && pwd)
build=${BUILD_DIR:-$here/../../../../build/native}
deps="libgrpc++-dev libprotobuf-dev protobuf-compiler pkg-config g++"
have() { pkg-config --exists grpc++ protobuf 2>/dev/null && command -v protoc >/dev/null; }
if ! have && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing gRPC C++ for the native exchange worker: $deps"
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2086
  apt-get install -y -q --no-install-recommends $deps >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends $deps >/dev/null; } ||
    true
fi
if ! have; then
  echo "exchange worker: python (the native one needs gRPC C++: $deps)"
  exit 0
fi
mkdir -p "$build" "$prefix/bin"
protoc -I"$here/../../../../protos" --cpp_out="$build" fastdecode/v1/exchange.proto
# shellcheck disable=SC2046
g++ -std=c++17 -O2 -Wall -Wextra -o "$build/fastdecode-exchange-worker" \
  "$here/exchange_worker.cpp" "$build/fastdecode/v1/exchange.pb.cc" -I"$build" \
  $(pkg-config --cflags --libs grpc++ protobuf) -lpthread
install -m 755 "$build/fastdecode-exchange-worker" "$prefix/bin/fastdecode-exchange-worker"
echo "exchange worker: native ($prefix/bin/fastdecode-exchange-worker)"

# Cross-compiling for aarch64 (Linux, glibc) on a Debian x86-64 machine: llama.cpp and kvtier both
# (scripts/bootstrap.sh with KVTIER_ARCH=arm64, `make build-arm64`). Debian's cross compilers
# (gcc-aarch64-linux-gnu, g++-aarch64-linux-gnu) and the arm64 -dev packages installed through
# multiarch (dpkg --add-architecture arm64): their libraries are in /usr/lib/aarch64-linux-gnu,
# their headers in /usr/include (the architecture-dependent ones in /usr/include/aarch64-linux-gnu).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
# libraries and packages from the arm64 side only; programs (pkg-config, the build tools) from the host
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
# pkg-config reads the arm64 .pc files, never the amd64 ones
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")
# tests and try_run go through qemu-user (the CPU model: KVTIER_ARM64_CPU, default max)
if (NOT DEFINED CMAKE_CROSSCOMPILING_EMULATOR)
    if (DEFINED ENV{KVTIER_ARM64_CPU})
        set(_kvt_qemu_cpu "$ENV{KVTIER_ARM64_CPU}")
    else()
        set(_kvt_qemu_cpu max)
    endif()
    set(CMAKE_CROSSCOMPILING_EMULATOR "qemu-aarch64-static;-cpu;${_kvt_qemu_cpu}" CACHE STRING "runs an aarch64 program here")
endif()

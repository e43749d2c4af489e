# cmake -DSRC=<source dir> -DOUT=<header> -P commit.cmake — run at every build (target
# kvt_commit): writes `#define KVT_GIT_COMMIT "<short hash>[-dirty]"` into OUT, only when it
# changed, so the binary names the code it was built from (not the commit CMake was configured
# at) and an unchanged commit rebuilds nothing.  "-dirty": tracked files differ from that commit.
set(ENV{GIT_OPTIONAL_LOCKS} 0) # no index refresh written: a build never races the user's git commands
execute_process(COMMAND git describe --always --dirty --abbrev=7 --exclude=*
                WORKING_DIRECTORY ${SRC} OUTPUT_VARIABLE c OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET
                RESULT_VARIABLE rc)
if (NOT rc EQUAL 0 OR NOT c)
    set(c "unknown")
endif()
set(text "#define KVT_GIT_COMMIT \"${c}\"\n")
if (EXISTS ${OUT})
    file(READ ${OUT} old)
endif()
if (NOT "${old}" STREQUAL "${text}")
    file(WRITE ${OUT} "${text}")
endif()

/* model.h — which GGUF a `kvtier` command runs when it is given no -m: the model
** scripts/bootstrap.sh cached, which `eval "$(scripts/bootstrap.sh env)"` names in $KVTIER_MODEL
** (`make demo` and `make serve` run that way).  Never installed. */
#ifndef KVT_CLI_MODEL_H
#define KVT_CLI_MODEL_H

#include <stdbool.h>

/* The model command `cmd` ("kvtier serve") runs: `given` (the -m value; NULL when -m was not
** given), else $KVTIER_MODEL, else the model the build was configured with (KVT_DEFAULT_MODEL:
** the bootstrap's cached Gemma 3 270M under `make build`) if that file is readable.
** OUT *from_env (may be NULL): true when -m was not given.  Returns the path (not to be freed),
** or NULL after printing "CMD: no model given (...)" on stderr.  Whether a given file exists is
** for the engine to say (kvt_engine_open names the path). */
const char *cli_model_path(const char *cmd, const char *given, bool *from_env);

#endif

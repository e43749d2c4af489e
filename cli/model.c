/* model.c — the model a command runs without -m (see model.h). */
#include "model.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

const char *cli_model_path(const char *cmd, const char *given, bool *from_env) {
    const char *m = given ? given : getenv("KVTIER_MODEL");
    if (from_env) *from_env = !given;
#ifdef KVT_DEFAULT_MODEL
    if ((!m || !*m) && KVT_DEFAULT_MODEL[0] && access(KVT_DEFAULT_MODEL, R_OK) == 0) m = KVT_DEFAULT_MODEL;
#endif
    if (!m || !*m) {
        fprintf(stderr,
                "%s: no model given (use -m MODEL, set KVTIER_MODEL, or run scripts/bootstrap.sh model and "
                "rebuild)\n",
                cmd);
        return NULL;
    }
    return m;
}

/* model.c — the model a command runs without -m (see model.h). */
#include "model.h"

#include <stdio.h>
#include <stdlib.h>

const char *cli_model_path(const char *cmd, const char *given, bool *from_env) {
    const char *m = given ? given : getenv("KVTIER_MODEL");
    if (from_env) *from_env = !given;
    if (!m || !*m) {
        fprintf(stderr, "%s: no model given (use -m MODEL or set KVTIER_MODEL)\n", cmd);
        return NULL;
    }
    return m;
}

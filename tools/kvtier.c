#include "kvtier.h"
#include <stdio.h>
int main(void) { puts(kvt_build_info()); return 0; }

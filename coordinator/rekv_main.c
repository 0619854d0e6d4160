/* rekv_main.c — the rekv client CLI. */
#include <stdio.h>
int main(void) { fprintf(stderr, "rekv: not built yet\n"); return 2; }

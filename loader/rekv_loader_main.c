/* rekv_loader_main.c — the rekv-loader CLI. */
#include <stdio.h>
int main(void) { fprintf(stderr, "rekv-loader: not built yet\n"); return 2; }

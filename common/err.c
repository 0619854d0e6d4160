/* err.c — see err.h. */
#include "common/err.h"

#include <stdarg.h>
#include <stdio.h>

int rekv_errf(rekv_err *err, int code, const char *fmt, ...)
{
    if (err == NULL || err->code != 0)
        return code;
    err->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
    va_end(ap);
    /* one line whatever the message quotes (a parser's excerpt of a file or a request, a name
     * read from one, a template's raise_exception): a line break or tab becomes a space, any
     * other control byte '?' */
    for (char *c = err->msg; *c; c++)
        if (*c == '\n' || *c == '\r' || *c == '\t')
            *c = ' ';
        else if ((unsigned char)*c < 0x20 || *c == 0x7f)
            *c = '?';
    return code;
}

void rekv_err_clear(rekv_err *err)
{
    if (err == NULL)
        return;
    err->code = 0;
    err->msg[0] = '\0';
}

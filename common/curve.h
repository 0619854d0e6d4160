/* curve.h — CurveZMQ for the clients of the coordinator's tcp:// endpoints (the CLI and the
 * worker). The coordinator's public key reaches them as $REKV_CURVE_SERVER_KEY (40 Z85
 * characters; the coordinator logs it at start when it has --curve-secret-file); ipc:// endpoints
 * are never CURVE'd (files, mode 0600). */
#ifndef REKV_COMMON_CURVE_H
#define REKV_COMMON_CURVE_H

#include "common/err.h"

/* The server key a client of endpoint uses: $REKV_CURVE_SERVER_KEY for a tcp:// endpoint, NULL
 * for any other or when it is unset. -EINVAL when it is set but not 40 Z85 characters. */
int rekv_curve_server_key(const char *endpoint, const char **key, rekv_err *err);

/* Makes the (not yet connected) zmq socket a CurveZMQ client of the server with this public key,
 * with a fresh key pair of its own. */
int rekv_curve_client(void *sock, const char *server_key, rekv_err *err);

#endif

/* curve.c — CurveZMQ clients (curve.h). */
#include "common/curve.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

int rekv_curve_server_key(const char *endpoint, const char **key, rekv_err *err)
{
    *key = NULL;
    const char *k = getenv("REKV_CURVE_SERVER_KEY");
    if (k == NULL || *k == '\0' || strncmp(endpoint, "tcp://", 6) != 0)
        return 0;
    uint8_t raw[32];
    if (strlen(k) != 40 || zmq_z85_decode(raw, k) == NULL)
        return rekv_errf(err, -EINVAL,
                         "REKV_CURVE_SERVER_KEY: expected the coordinator's public key, 40 Z85 "
                         "characters");
    *key = k;
    return 0;
}

int rekv_curve_client(void *sock, const char *server_key, rekv_err *err)
{
    char pub[41], sec[41];
    if (zmq_curve_keypair(pub, sec) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, server_key, 40) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, pub, 40) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, sec, 40) != 0)
        return rekv_errf(err, -EINVAL, "CurveZMQ setup failed: %s", zmq_strerror(errno));
    return 0;
}

/* Records the name of every getenv()/secure_getenv() call, one per line, in the file $GETENV_RECORD.
 * Built and LD_PRELOADed by tests/agent/test_import_env.py. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

static char *(*real_getenv)(const char *);
static char *(*real_secure_getenv)(const char *);
static int record_fd = -2;

static void record(const char *name) {
    if (record_fd == -2) {
        const char *path = real_getenv("GETENV_RECORD");
        record_fd = path ? open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600) : -1;
    }
    if (record_fd >= 0 && name) {
        (void)!write(record_fd, name, strlen(name));
        (void)!write(record_fd, "\n", 1);
    }
}

char *getenv(const char *name) {
    if (!real_getenv) real_getenv = (char *(*)(const char *))dlsym(RTLD_NEXT, "getenv");
    record(name);
    return real_getenv(name);
}

char *secure_getenv(const char *name) {
    if (!real_getenv) real_getenv = (char *(*)(const char *))dlsym(RTLD_NEXT, "getenv");
    if (!real_secure_getenv) real_secure_getenv = (char *(*)(const char *))dlsym(RTLD_NEXT, "secure_getenv");
    record(name);
    return real_secure_getenv(name);
}

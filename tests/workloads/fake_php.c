/* A process that looks like a PHP build the runtime reader must refuse (no ZTS PHP is
 * packaged anywhere these tests can reach, so its refusal is tested on this).
 *
 * Built with -DZTS: the markers of a thread-safe build, as php-src's ZTS builds have
 * them: the module build id "API20220829,TS", and the exported executor_globals_offset
 * and tsrm_get_ls_cache (TSRM keeps the executor globals in each thread's storage, so
 * there is no executor_globals symbol). Built without it: an NTS PHP 7.4 (build id
 * "API20190902,NTS", executor_globals exported), a version the reader does not read.
 * Both carry "X-Powered-By: PHP/<version>" as PHP's own binaries do. The file must be
 * named php<version> (the reader goes by the name). It prints "ready" once set up,
 * then waits for stdin to close (or 240 s) and exits.
 */
#include <stdio.h>
#include <unistd.h>
#include <poll.h>

#ifdef ZTS
const char php_version_banner[] = "X-Powered-By: PHP/8.2.7";
const char php_build_id[] = "API20220829,TS";
size_t executor_globals_offset = 1024;
void *tsrm_get_ls_cache(void) { return 0; }
#else
const char php_version_banner[] = "X-Powered-By: PHP/7.4.33";
const char php_build_id[] = "API20190902,NTS";
char executor_globals[1800];
#endif

int main(void) {
    printf("ready %s %s\n", php_version_banner, php_build_id);
    fflush(stdout);
    struct pollfd in = {0, POLLIN, 0};
    poll(&in, 1, 240 * 1000);
    return 0;
}

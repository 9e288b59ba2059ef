/* kph-open PATH...: open each path and print what the syscall returned (fd or -errno),
 * one "PATH RESULT" line each, keeping the files open. The ground truth a host-side
 * kretprobe on do_sys_openat2 is compared with. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>

int main(int argc, char **argv)
{
	for (int i = 1; i < argc; i++) {
		int fd = open(argv[i], O_RDONLY);
		printf("%s %d\n", argv[i], fd < 0 ? -errno : fd);
	}
	return 0;
}

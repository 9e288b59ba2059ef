/* kph-efault: make the kernel copy a path from an unmapped user address.
 *
 * open() hands the pointer to strncpy_from_user(), whose load from 0x1000 page-faults;
 * the exception table turns that into -EFAULT. A host-side kprobe with a fault_handler
 * on that load sees trapnr 14 and cr2 == 0x1000.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv)
{
	unsigned long addr = argc > 1 ? strtoul(argv[1], NULL, 0) : 0x1000;
	int fd = open((const char *)addr, O_RDONLY);

	printf("open(%#lx) = %d errno %d\n", addr, fd, fd < 0 ? errno : 0);
	return fd < 0 && errno == EFAULT ? 0 : 1;
}

/* kph-forkexec [GOFILE]: print our pid, wait until GOFILE exists (so a probe can be armed
 * on this pid first), then kph_tick(1); fork: the child calls kph_tick(100) and exits, the
 * parent waits, calls kph_tick(2), and execs itself as "kph-forkexec --after", which calls
 * kph_tick(200): same file, same address, same pid, a new mm. */
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

__attribute__((noinline)) long kph_tick(long v)
{
	asm volatile("" ::: "memory");
	return v + 1;
}

int main(int argc, char **argv)
{
	if (argc > 1 && strcmp(argv[1], "--after") == 0) {
		printf("after %ld\n", kph_tick(200));
		return 0;
	}
	printf("%d\n", getpid());
	fflush(stdout);
	if (argc > 1)
		for (int i = 0; i < 3000 && access(argv[1], F_OK) != 0; i++)
			usleep(10000);
	kph_tick(1);
	pid_t child = fork();
	if (child == 0) {
		kph_tick(100);
		_exit(0);
	}
	waitpid(child, NULL, 0);
	kph_tick(2);
	fflush(stdout);
	execl("/proc/self/exe", "kph-forkexec", "--after", (char *)NULL);
	perror("exec");
	return 1;
}

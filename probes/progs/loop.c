/* kph-loop [N] [WORD] [GOFILE]: call kph_add(i, 3*i, WORD) N times (default 5) and print
 * the sum. With GOFILE: print our pid first and wait (up to 30 s) until GOFILE exists,
 * so a probe can be armed on this very process.
 * The uprobe target: kph_add is noinline with plain integer arguments in rdi/rsi and a
 * user-memory string in rdx, so every fetch-arg form has something to read. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

__attribute__((noinline)) long kph_add(long a, long b, const char *word)
{
	asm volatile("" ::: "memory");
	return a + b + (long)strlen(word);
}

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 5, sum = 0;
	const char *word = argc > 2 ? argv[2] : "kph";

	if (argc > 3) {
		printf("%d\n", getpid());
		fflush(stdout);
		for (int i = 0; i < 3000 && access(argv[3], F_OK) != 0; i++)
			usleep(10000);
	}

	for (long i = 0; i < n; i++)
		sum += kph_add(i, 3 * i, word);
	printf("%ld\n", sum);
	return 0;
}

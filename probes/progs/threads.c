/* kph-threads [T] [N]: T threads (default 4) each call kph_work(t, i) N times (default 5);
 * print the total. Threads share one mm, so a uprobe fires in all of them; their
 * uretprobe instances live on different stacks. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

static long n_calls = 5;

__attribute__((noinline)) long kph_work(long t, long i)
{
	asm volatile("" ::: "memory");
	return t * 1000 + i;
}

static void *run(void *arg)
{
	long t = (long)arg, sum = 0;

	for (long i = 0; i < n_calls; i++)
		sum += kph_work(t, i);
	return (void *)sum;
}

int main(int argc, char **argv)
{
	long nt = argc > 1 ? atol(argv[1]) : 4, total = 0;
	pthread_t th[64];

	n_calls = argc > 2 ? atol(argv[2]) : 5;
	if (nt > 64)
		nt = 64;
	for (long t = 0; t < nt; t++)
		pthread_create(&th[t], NULL, run, (void *)t);
	for (long t = 0; t < nt; t++) {
		void *r;

		pthread_join(th[t], &r);
		total += (long)r;
	}
	printf("%ld\n", total);
	return 0;
}

/* kph-recurse [N]: kph_fact(N) by real recursion (default 5), printed. Each level is a
 * call with its own return-address slot, so a uretprobe sees N nested instances that must
 * return innermost first with the right values. */
#include <stdio.h>
#include <stdlib.h>

__attribute__((noinline, optimize("no-optimize-sibling-calls"))) long kph_fact(long n)
{
	long r;

	if (n <= 1)
		return 1;
	r = kph_fact(n - 1);
	asm volatile("" : "+r"(r));	/* keep the multiply after the call: no accumulator loop */
	return n * r;
}

int main(int argc, char **argv)
{
	printf("%ld\n", kph_fact(argc > 1 ? atol(argv[1]) : 5));
	return 0;
}

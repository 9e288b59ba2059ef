"""Guest images: where they live, how they are built, and what each kernel is.

- ``store``      the image store under ``KPH_CACHE`` and the embedded default image;
- ``build``      ``kph image build``: kernel, modules, initramfs, the harness's module;
- ``facts``      what one booted kernel is (version, config, symbols, BTF), as KernelFacts;
- ``kernels``    the kernel matrix: which Debian kernels, resolved at build time;
- ``debian``     Debian's package index and .debs, checked by sha256;
- ``toolchain``  the compiler and headers a kernel's modules need.
"""

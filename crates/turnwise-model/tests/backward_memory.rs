//! The vendored candle-core's one patch (vendor/README.md): its backward pass stores a
//! gradient's first contribution instead of adding it to a fresh tensor of zeros. The published
//! crate allocates and zeroes a gradient-sized tensor and then a second one for the sum at
//! every node; this counts the bytes `backward` allocates on a small graph of 4 MiB tensors.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType, Device, Tensor, Var};

struct Counting;

static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call forwards to the system allocator unchanged; the counter only observes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATED.fetch_add(new_size, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn backward_allocates_no_zeros_to_add_a_first_gradient_to() {
    const N: usize = 1 << 20;
    let tensor_bytes = N * 4;
    let dev = Device::Cpu;
    let x = Var::from_tensor(&Tensor::arange(0f32, N as f32, &dev).unwrap()).unwrap();
    let a = (Tensor::ones(N, DType::F32, &dev).unwrap() * 0.5).unwrap();
    let b = Tensor::ones(N, DType::F32, &dev).unwrap();
    // loss = Σ h ∘ h with h = x ∘ a + b: a product, a sum with a constant, a tensor used twice.
    let h = ((x.as_tensor() * &a).unwrap() + &b).unwrap();
    let loss = (&h * &h).unwrap().sum_all().unwrap();

    let before = ALLOCATED.load(Ordering::Relaxed);
    let grads = loss.backward().unwrap();
    let bytes = ALLOCATED.load(Ordering::Relaxed) - before;

    // d loss / dx = 2 (x a + b) a = x / 2 + 1.
    let g = grads.get(x.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
    for (i, v) in g.iter().enumerate().step_by(4099) {
        assert_eq!(*v, i as f32 / 2.0 + 1.0, "gradient at {i}");
    }
    // What the graph needs: the sum's gradient broadcast out (1 tensor), the square's two
    // products and their sum (3), the product's two (2): 6 tensors. The published backward
    // adds a zero tensor and a sum for every first contribution (17 tensors here).
    let tensors = bytes as f64 / tensor_bytes as f64;
    assert!(
        tensors <= 6.5,
        "backward allocated {tensors:.1} tensors of 4 MiB (6 needed)"
    );
}

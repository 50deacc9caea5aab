package protocol

import (
	"math/bits"
	"sort"
	"strings"

	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// MaxTensorDims is the most dimensions a TensorDesc may have.
const MaxTensorDims = 32

// DTypeSizes maps every dtype name a TensorDesc may carry to its size in
// bytes. The names are NumPy's and PyTorch's.
var DTypeSizes = map[string]int64{
	"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2,
	"int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
	"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
	"complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
}

// dtypeNames lists DTypeSizes' keys, sorted, for error messages.
var dtypeNames = func() string {
	names := make([]string, 0, len(DTypeSizes))
	for n := range DTypeSizes {
		names = append(names, n)
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}()

// TensorExtent returns the number of bytes a TensorDesc spans from its
// first element: (1 + Σ (shape[i]-1)·strides[i]) · itemsize, or 0 when a
// dimension is 0. ok is false when it does not fit in an int64.
func TensorExtent(t *storev1.TensorDesc) (n int64, ok bool) {
	shape, strides := t.GetShape(), t.GetStrides()
	item := DTypeSizes[t.GetDtype()]
	for _, d := range shape {
		if d == 0 {
			return 0, true
		}
	}
	if len(strides) == 0 { // C-contiguous
		n = item
		for _, d := range shape {
			hi, lo := bits.Mul64(uint64(n), uint64(d))
			if hi != 0 || lo > 1<<62 {
				return 0, false
			}
			n = int64(lo)
		}
		return n, true
	}
	last := uint64(0) // index of the last element, in elements
	for i, d := range shape {
		hi, lo := bits.Mul64(uint64(d-1), uint64(strides[i]))
		if hi != 0 || lo > 1<<62 {
			return 0, false
		}
		if last += lo; last > 1<<62 {
			return 0, false
		}
	}
	hi, lo := bits.Mul64(last+1, uint64(item))
	if hi != 0 || lo > 1<<62 {
		return 0, false
	}
	return int64(lo), true
}

// ValidateTensor checks a TensorDesc for an object of size bytes: a known
// dtype, at most MaxTensorDims non-negative dimensions, strides either
// absent or one non-negative stride per dimension, and an extent that fits
// in size. A nil desc is valid (objects need not be typed). The error is a
// *CodeError with code INVALID.
func ValidateTensor(t *storev1.TensorDesc, size uint64) error {
	if t == nil {
		return nil
	}
	if _, ok := DTypeSizes[t.GetDtype()]; !ok {
		return Errorf(storev1.Error_INVALID, "tensor dtype %q is not one of %s", t.GetDtype(), dtypeNames)
	}
	shape, strides := t.GetShape(), t.GetStrides()
	if len(shape) > MaxTensorDims {
		return Errorf(storev1.Error_INVALID, "tensor has %d dimensions, at most %d", len(shape), MaxTensorDims)
	}
	if len(strides) != 0 && len(strides) != len(shape) {
		return Errorf(storev1.Error_INVALID, "tensor has %d strides for %d dimensions (give none for C order, or one per dimension)", len(strides), len(shape))
	}
	for i, d := range shape {
		if d < 0 {
			return Errorf(storev1.Error_INVALID, "tensor shape[%d] is %d: must not be negative", i, d)
		}
	}
	for i, s := range strides {
		if s < 0 {
			return Errorf(storev1.Error_INVALID, "tensor strides[%d] is %d: must not be negative", i, s)
		}
	}
	n, ok := TensorExtent(t)
	if !ok || uint64(n) > size {
		return Errorf(storev1.Error_INVALID, "tensor %s%v spans more than the object's %d bytes", t.GetDtype(), shape, size)
	}
	return nil
}

package cu

import (
	"testing"
	"unsafe"
)

// The offsets and sizes of cuda.h's structs on LP64 (x86_64 and aarch64
// Linux), as a C compiler lays them out. A wrong layout would make the
// driver read garbage properties, so check every field.
func TestVMMStructLayout(t *testing.T) {
	var p MemAllocationProp
	var a MemAccessDesc
	var l MemLocation
	var f MemAllocFlags
	for _, c := range []struct {
		name      string
		got, want uintptr
	}{
		{"sizeof(CUmemLocation)", unsafe.Sizeof(l), 8},
		{"offsetof(CUmemLocation, id)", unsafe.Offsetof(l.ID), 4},
		{"sizeof(allocFlags)", unsafe.Sizeof(f), 8},
		{"offsetof(allocFlags, gpuDirectRDMACapable)", unsafe.Offsetof(f.GPUDirectRDMACapable), 1},
		{"offsetof(allocFlags, usage)", unsafe.Offsetof(f.Usage), 2},
		{"offsetof(allocFlags, reserved)", unsafe.Offsetof(f.Reserved), 4},
		{"sizeof(CUmemAllocationProp)", unsafe.Sizeof(p), 32},
		{"alignof(CUmemAllocationProp)", unsafe.Alignof(p), 8},
		{"offsetof(CUmemAllocationProp, type)", unsafe.Offsetof(p.Type), 0},
		{"offsetof(CUmemAllocationProp, requestedHandleTypes)", unsafe.Offsetof(p.RequestedHandleTypes), 4},
		{"offsetof(CUmemAllocationProp, location)", unsafe.Offsetof(p.Location), 8},
		{"offsetof(CUmemAllocationProp, win32HandleMetaData)", unsafe.Offsetof(p.Win32HandleMetaData), 16},
		{"offsetof(CUmemAllocationProp, allocFlags)", unsafe.Offsetof(p.AllocFlags), 24},
		{"sizeof(CUmemAccessDesc)", unsafe.Sizeof(a), 12},
		{"offsetof(CUmemAccessDesc, flags)", unsafe.Offsetof(a.Flags), 8},
		{"sizeof(CUmemGenericAllocationHandle)", unsafe.Sizeof(MemGenericAllocationHandle(0)), 8},
	} {
		if c.got != c.want {
			t.Errorf("%s = %d, want %d", c.name, c.got, c.want)
		}
	}
}

func TestDevicePinnedProp(t *testing.T) {
	p := DevicePinnedProp(3, MemHandleTypePosixFD)
	want := MemAllocationProp{Type: 1, RequestedHandleTypes: 1, Location: MemLocation{Type: 1, ID: 3}}
	if p != want {
		t.Fatalf("got %+v, want %+v", p, want)
	}
}

package cudaipc

import (
	"errors"

	"github.com/cudaipc/cudaipc/internal/cu"
)

// Expandable is a VA range backed by several VMM allocations mapped back to
// back, as PyTorch's expandable segments make: for tests of ExportPointer.
type Expandable struct {
	dev     *Device
	base    cu.DevicePtr
	piece   int64
	handles []cu.MemGenericAllocationHandle
}

// NewExpandableForTest maps n allocations of one granule each (handle
// types handleTypes: 1 = POSIX fd, 0 = none) into one reserved range.
func NewExpandableForTest(d *Device, n int, posixFD bool) (*Expandable, error) {
	ht := cu.MemHandleTypeNone
	if posixFD {
		ht = cu.MemHandleTypePosixFD
	}
	g, err := d.VMMGranularity()
	if err != nil {
		return nil, err
	}
	e := &Expandable{dev: d, piece: g}
	err = d.do(func() error {
		p, err := cu.MemAddressReserve(uint64(g)*uint64(n), uint64(g))
		if err != nil {
			return err
		}
		e.base = p
		for i := 0; i < n; i++ {
			h, err := cu.MemCreate(uint64(g), cu.DevicePinnedProp(d.dev, ht))
			if err != nil {
				return err
			}
			e.handles = append(e.handles, h)
			if err := cu.MemMap(p+cu.DevicePtr(int64(i)*g), uint64(g), h); err != nil {
				return err
			}
			if err := cu.MemSetAccess(p+cu.DevicePtr(int64(i)*g), uint64(g), d.dev, cu.MemAccessFlagsProtReadWrite); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, errors.Join(err, e.Free())
	}
	return e, nil
}

// Ptr returns the range's start.
func (e *Expandable) Ptr() DevicePtr { return DevicePtr(e.base) }

// Size returns the range's length.
func (e *Expandable) Size() int64 { return e.piece * int64(len(e.handles)) }

// Piece returns each allocation's size.
func (e *Expandable) Piece() int64 { return e.piece }

// Free unmaps and releases everything.
func (e *Expandable) Free() error {
	if e.base == 0 {
		return nil
	}
	pieces := make([]int64, len(e.handles))
	for i := range pieces {
		pieces[i] = e.piece
	}
	err := e.dev.do(func() error { return unmapPieces(e.base, pieces, e.handles) })
	e.base, e.handles = 0, nil
	return err
}

package cudaipc

import (
	"fmt"

	"github.com/cudaipc/cudaipc/internal/cu"
)

// IPCFlags are the flags of OpenMemHandle.
type IPCFlags uint32

// LazyEnablePeerAccess (CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) lets the driver
// enable peer access when the handle belongs to another GPU. The driver
// requires it: OpenMemHandle rejects flags without it.
const LazyEnablePeerAccess IPCFlags = IPCFlags(cu.IpcMemLazyEnablePeerAccess)

// GetMemHandle exports the allocation that contains p (cuIpcGetMemHandle).
// An interior pointer yields the same handle as the allocation's base: the
// offset is lost, so send it beside the handle (Region does that).
// Memory from cuMemAllocAsync pools or managed memory cannot be exported
// (ErrInvalidValue).
func (d *Device) GetMemHandle(p DevicePtr) (MemHandle, error) {
	if p == 0 {
		return MemHandle{}, &ArgError{Op: "GetMemHandle", Arg: "pointer", Reason: "nil device pointer"}
	}
	var h cu.IpcMemHandle
	err := d.do(func() error {
		var e error
		h, e = cu.IpcGetMemHandle(cu.DevicePtr(p))
		return e
	})
	return MemHandle(h.Reserved), err
}

// OpenMemHandle maps an allocation exported by another process into this
// device's context and returns its base address (cuIpcOpenMemHandle). With
// no flags it passes LazyEnablePeerAccess, the only flag the driver defines
// and one it requires, so a handle from another GPU is reachable through
// peer access; flags given explicitly are OR-ed and checked, and 0 (which
// the driver rejects) is refused with an *ArgError before the call.
//
// Opening a handle that this process already has open returns the same
// address, and every open needs its own CloseMemHandle. Opening a handle in
// the process that exported it fails with ErrDeviceUninitialized (Region
// and Import handle that case for you). Each open costs tens of
// microseconds to milliseconds: cache mappings (Import does).
func (d *Device) OpenMemHandle(h MemHandle, flagList ...IPCFlags) (DevicePtr, error) {
	flags := LazyEnablePeerAccess
	if len(flagList) > 0 {
		flags = 0
		for _, f := range flagList {
			flags |= f
		}
	}
	if flags&LazyEnablePeerAccess == 0 {
		return 0, &ArgError{Op: "OpenMemHandle", Arg: "flags", Reason: fmt.Sprintf("%#x lacks LazyEnablePeerAccess (0x1), which the driver requires", uint32(flags))}
	}
	if flags&^LazyEnablePeerAccess != 0 {
		return 0, &ArgError{Op: "OpenMemHandle", Arg: "flags", Reason: fmt.Sprintf("%#x has bits the driver does not define", uint32(flags))}
	}
	if h.IsZero() {
		return 0, &ArgError{Op: "OpenMemHandle", Arg: "handle", Reason: "all zero bytes: not an exported handle"}
	}
	var p cu.DevicePtr
	err := d.do(func() error {
		var e error
		p, e = cu.IpcOpenMemHandle(cu.IpcMemHandle{Reserved: h}, cu.IpcMemFlags(flags))
		return e
	})
	if err != nil {
		return 0, err
	}
	live.memOpens.Add(1)
	return DevicePtr(p), nil
}

// CloseMemHandle undoes one OpenMemHandle of the mapping at base. The
// memory stays mapped until the last close.
func (d *Device) CloseMemHandle(base DevicePtr) error {
	if base == 0 {
		return &ArgError{Op: "CloseMemHandle", Arg: "pointer", Reason: "nil device pointer"}
	}
	err := d.do(func() error { return cu.IpcCloseMemHandle(cu.DevicePtr(base)) })
	if err == nil {
		live.memOpens.Add(-1)
	}
	return err
}

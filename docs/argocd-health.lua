-- Argo CD health check for Loom's kinds (loom.dev: TrainingJob, InferenceService, InferenceGraph, FeatureView).
-- One script for all four: every kind has status.observedGeneration, a phase and a Ready condition.
-- Install it under resource.customizations.health.loom.dev_<Kind> in argocd-cm (docs/argocd.md).
-- Tested on Lua 5.1 (Argo CD's gopher-lua) by tests/unit/test_argocd_health.py and e2e/tests/test_gitops.py.
local hs = {status = "Progressing", message = "Waiting for the Loom operator"}
if obj.status == nil then
  return hs
end
local generation = obj.metadata ~= nil and obj.metadata.generation or nil
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.message = "Waiting for the Loom operator to observe generation " .. tostring(generation)
  return hs
end
local ready = nil
if obj.status.conditions ~= nil then
  for _, condition in ipairs(obj.status.conditions) do
    if condition.type == "Ready" then
      ready = condition
    end
  end
end
local phase = obj.status.phase
local function says(default)
  if ready ~= nil and ready.message ~= nil and ready.message ~= "" then
    return ready.message
  end
  return default
end
if phase == "Failed" then
  hs.status = "Degraded"
  hs.message = says("Failed")
  return hs
end
if phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = says("Suspended")
  return hs
end
if ready == nil then
  hs.message = "No Ready condition yet (phase " .. tostring(phase) .. ")"
  return hs
end
if ready.status == "True" then
  -- Serving with fewer replicas than asked (InferenceService, InferenceGraph): up, but not as declared.
  if phase == "Degraded" then
    hs.status = "Degraded"
  else
    hs.status = "Healthy"
  end
  hs.message = says(tostring(phase))
  return hs
end
-- Ready is False. Scaled to zero is what the user asked for; a problem only a person can fix is Degraded;
-- anything else is still converging (pods starting, a model loading, a dependency not synced yet).
local reason = ready.reason or ""
if reason == "ScaledToZero" then
  hs.status = "Healthy"
elseif string.find(reason, "^Invalid") or string.find(reason, "Failed$") or string.find(reason, "Error$")
    or string.find(reason, "Exceeded$") or string.find(reason, "BackOff$") or reason == "Unschedulable"
    or reason == "HandlerRequired" or reason == "NoCheckpointStore" or reason == "PermanentError"
    or reason == "FeatureViewMismatch" then
  hs.status = "Degraded"
end
hs.message = reason .. ": " .. says(tostring(phase))
return hs
